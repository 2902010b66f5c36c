"""Kolibri-1 (`Kolibri1ForCausalLM`), following transformers' modeling_kolibri1 numerically: Qwen3-MoE's attention
(q/k RMSNorm per head) in a hybrid of windowed and global layers, sandwich norms, and an MoE block on every layer.

Shapes: B batch, T tokens, D hidden, E experts, K top-k.

- Attention: layer i is windowed ("sliding_attention": `sliding_window` positions, q and k rotated) or global
  ("full_attention": NoPE), by `layer_types` (transformers' default: every fifth layer global). A null
  sliding_window is refused: transformers' Kolibri-1 cannot run one either.
- Sandwich norms: the attention's output and the MoE's output are each normalised before their residual sum
  (the checkpoint's `post_attn_norm` / `post_ffn_norm`), as their inputs are (input_layernorm /
  post_attention_layernorm).
- MoE: float32 router logits; the top-k chosen on the logits plus a routing bias (the checkpoint's
  `moe.router.expert_bias`, added to the logits, not to their sigmoid) and weighted by the sigmoid of their logits,
  renormalised with norm_topk_prob (false by default); num_experts experts and an ungated shared expert of
  shared_expert_intermediate_size, which the registry never fuses (our choice: its width is its own). transformers saves
  the expert count as num_local_experts (num_experts is its alias).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loadplan.layouts import kolibri1_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..parallel.tensor import TensorParallel
from ..weights import CheckpointNames
from .config import ConfigError, Family, transformers_defaults, whole_heads, windowed_layers
from .qwen_moe import Float32RouterMoeBlock, QwenDecoderLayer, QwenLayerCausalLM, QwenMoeConfig

ARCHITECTURE = "Kolibri1ForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}.
KOLIBRI1_NAMES = CheckpointNames((
    ("moe.router.expert_bias", "mlp.e_score_correction_bias"),
    ("post_attn_norm.weight", "post_self_attn_layernorm.weight"),
    ("post_ffn_norm.weight", "post_mlp_layernorm.weight"),
    *((f"mlp.shared_experts.{p}.weight", f"mlp.shared_mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")),
))


@dataclass(frozen=True)
class Kolibri1Config(QwenMoeConfig):
    layer_types: tuple[str, ...] = ()


def _a_window(d: dict, fields: dict) -> None:
    if "sliding_window" in d and d["sliding_window"] is None:
        raise ConfigError("config.sliding_window: null is not supported (transformers' Kolibri-1 cannot run "
                          "without a window either)")


# transformers' Kolibri1Config defaults where a checkpoint may leave a field out; no dense layer, no biases.
KOLIBRI1 = Family(ARCHITECTURE, kolibri1_layout, dict(
    transformers_defaults(vocab_size=128000, hidden_size=2560, num_attention_heads=48, num_key_value_heads=4,
                          head_dim=128, max_position_embeddings=262144),
    moe_intermediate_size=512, norm_topk_prob=False, shared_intermediate_size=512),
    names=dict(shared_intermediate_size="shared_expert_intermediate_size"),
    fixed={"intermediate_size": lambda f: f.moe_intermediate_size, "qkv_bias": False, "o_bias": False,
           "qk_norm": True},
    own=(_a_window, windowed_layers(lambda i, n: "full_attention" if (i + 1) % 5 == 0 else "sliding_attention", 513),
         whole_heads("Kolibri-1")))


class Kolibri1MoeBlock(Float32RouterMoeBlock):
    """float32 router logits, the top-k of the logits plus the routing bias weighted by the logits' sigmoid, the
    routed experts and the ungated shared MLP."""

    def __init__(self, cfg: Kolibri1Config, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        logits = self.router_logits(x)                                              # [T, E] float32
        ids = torch.topk(logits + self.e_score_correction_bias, self.top_k, dim=-1)[1]   # [T, K]
        weights = logits.gather(1, ids).sigmoid()                                   # [T, K]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        y = self.experts(x, ids, weights.to(x.dtype))                               # [T, D], reduced if the plan says
        return y + self.shared_mlp(x)


class Kolibri1DecoderLayer(QwenDecoderLayer):
    """x + post_self_attn_layernorm(attn(input_layernorm(x))), then
    x + post_mlp_layernorm(mlp(post_attention_layernorm(x)))."""

    MOE_BLOCK = Kolibri1MoeBlock

    @classmethod
    def make_attention(cls, cfg: Kolibri1Config, layer_id: int, dtype: torch.dtype,
                       tp: TensorParallel) -> GQAttention:
        windowed = cfg.layer_types[layer_id] == "sliding_attention"
        return GQAttention(AttentionSpec.of(cfg, qk_norm="head",
                                            sliding_window=cfg.sliding_window if windowed else None, use_rope=windowed),
                           tp=tp, dtype=dtype)

    def __init__(self, cfg: Kolibri1Config, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        self.post_self_attn_layernorm = self.NORM(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_mlp_layernorm = self.NORM(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x, cos, sin, input_pos=None):
        """x [B, T, D] -> [B, T, D]"""
        x = x + self.post_self_attn_layernorm(self.mixer(self.input_layernorm(x), cos, sin, input_pos))
        B, T, D = x.shape
        h = self.post_attention_layernorm(x).reshape(B * T, D)
        return x + self.post_mlp_layernorm(self.mlp(h)).view(B, T, D)


class Kolibri1ForCausalLM(QwenLayerCausalLM):
    ARCHITECTURE = ARCHITECTURE
    CHECKPOINT_NAMES = KOLIBRI1_NAMES
    DECODER_LAYER = Kolibri1DecoderLayer

    FAMILY = KOLIBRI1
    CONFIG = Kolibri1Config
