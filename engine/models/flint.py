"""Flint (`FlintForCausalLM`), following transformers' modeling_flint numerically: Qwen3-MoE's layer
(models/qwen_moe.py) with sink logits, windowed layers and a sigmoid router.

Shapes: T tokens, D hidden, E experts, K top-k.

- Attention: grouped-query with per-head q/k RMSNorm and a learned sink logit per head on every layer (gpt-oss's:
  the checkpoint's `self_attn.softmax_offset`); layer i is windowed (`sliding_window` positions, q and k rotated) or
  global (NoPE: not rotated), by `layer_types` (transformers' default: the first two, every fourth from the second,
  and the last global).
- Layer i is sparse iff it is not in mlp_only_layers (by default the first two) and (i + 1) % decoder_sparse_step ==
  0. MoE: float32 router logits, the top-k of their sigmoid (no routing bias), renormalised with norm_topk_prob; an
  ungated shared expert of shared_expert_intermediate_size always added (the checkpoint's `mlp.shared_expert`), which
  the registry never fuses (our choice: its width is its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loadplan.layouts import flint_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..parallel.tensor import TensorParallel
from ..weights import CheckpointNames
from .config import Family, transformers_defaults, whole_heads, windowed_layers
from .qwen_moe import Float32RouterMoeBlock, QwenDecoderLayer, QwenLayerCausalLM, QwenMoeConfig

ARCHITECTURE = "FlintForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}.
FLINT_NAMES = CheckpointNames((
    ("self_attn.softmax_offset", "self_attn.sinks"),
    *((f"mlp.shared_expert.{p}.weight", f"mlp.shared_mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")),
))


@dataclass(frozen=True)
class FlintConfig(QwenMoeConfig):
    layer_types: tuple[str, ...] = ()


# transformers' FlintConfig defaults where a checkpoint may leave a field out; its default layer_types: the first
# two, every fourth from the second, and the last global.
FLINT = Family(ARCHITECTURE, flint_layout, dict(
    transformers_defaults(vocab_size=150144, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, max_position_embeddings=262144),
    intermediate_size=6144, moe_intermediate_size=512, norm_topk_prob=True, qkv_bias=False,
    shared_intermediate_size=1024),
    names=dict(qkv_bias="attention_bias", shared_intermediate_size="shared_expert_intermediate_size"),
    fixed={"o_bias": lambda f: f.qkv_bias, "qk_norm": True},
    own=(windowed_layers(lambda i, n: "full_attention" if i < 2 or i % 4 == 1 or i == n - 1 else "sliding_attention",
                         513), whole_heads("Flint")))


class FlintMoeBlock(Float32RouterMoeBlock):
    """float32 router logits, the top-k of their sigmoid renormalised, the routed experts and the ungated shared MLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        logits = self.router_logits(x)                                     # [T, E] float32
        weights, ids = torch.topk(logits.sigmoid(), self.top_k, dim=-1)    # [T, K] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        y = self.experts(x, ids, weights.to(x.dtype))                      # [T, D], reduced if the plan says
        return y if self.shared_mlp is None else y + self.shared_mlp(x)


class FlintDecoderLayer(QwenDecoderLayer):
    MOE_BLOCK = FlintMoeBlock

    @classmethod
    def make_attention(cls, cfg: FlintConfig, layer_id: int, dtype: torch.dtype, tp: TensorParallel) -> GQAttention:
        windowed = cfg.layer_types[layer_id] == "sliding_attention"
        return GQAttention(AttentionSpec.of(cfg, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm="head",
                                            sliding_window=cfg.sliding_window if windowed else None, sinks=True,
                                            use_rope=windowed), tp=tp, dtype=dtype)


class FlintForCausalLM(QwenLayerCausalLM):
    ARCHITECTURE = ARCHITECTURE
    CHECKPOINT_NAMES = FLINT_NAMES
    DECODER_LAYER = FlintDecoderLayer

    FAMILY = FLINT
    CONFIG = FlintConfig
