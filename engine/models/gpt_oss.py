"""gpt-oss (gpt-oss-20b, gpt-oss-120b), numerically following transformers' modeling_gpt_oss.

Shapes: T tokens, D hidden, E experts, K top-k, I expert width, H heads.

What sets it apart from the Qwen-style layers (qwen_moe.py):
- attention: biases on q/k/v/o, a learned sink logit per head in every softmax
  (layers/attention.py `sinks`), and a sliding window on the layers `layer_types` marks
  `sliding_attention` (by default every even layer), full attention on the others;
  YaRN rotary with `truncate: false` as shipped (rope theta 150000);
- router: a linear layer WITH bias, top-k taken on the logits, then a softmax over
  those K logits only (not softmax -> top-k);
- experts: gate/up and down projections with biases, and the clamped SwiGLU
  (up.clamp(+-limit) + 1) * gate.clamp(max=limit) * sigmoid(alpha * gate)
  (expert_kernel.ClampedSwiGLU); every layer sparse, no shared expert, so no fusion.

The checkpoint holds each layer's experts stacked, as transformers keeps them:
`mlp.experts.gate_up_proj` [E, D, 2I] with gate and up INTERLEAVED along the last
dimension (gate = [..., 0::2], up = [..., 1::2]), `gate_up_proj_bias` [E, 2I] (same
interleave), `down_proj` [E, I, D] and `down_proj_bias` [E, D]. `StackedExperts`
(engine/stacked_experts.py) shows them to the loader one expert at a time in the engine's spelling
(`mlp.experts.{e}.gate_proj.weight` [I, D], ...), so EP shares, EPLB replicas, TP
splits and the hard checks are the same as for any family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loadplan.layouts import mixtral_layout
from ..expert_kernel import ClampedSwiGLU
from ..layers.attention import AttentionSpec, GQAttention
from ..moe import RoutedExperts
from ..parallel.tensor import TensorParallel
from ..stacked_experts import StackedExperts
from .causal_lm import BlockLayer, DeclaredCausalLM
from .config import (REQUIRED, ConfigError, DecoderConfig, get_field as _get, moe_layout, per_layer, read_fields,
                     read_rope, window_of)

ARCHITECTURE = "GptOssForCausalLM"
LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' GptOssConfig when config.json gives no rope_scaling / rope_parameters.
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass(frozen=True)
class GptOssConfig(DecoderConfig):
    intermediate_size: int              # every expert's width
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    attention_bias: bool
    sliding_window: int | None
    layer_types: tuple[str, ...]
    swiglu_alpha: float
    swiglu_limit: float
    moe_layers: tuple[int, ...]

    @classmethod
    def from_hf(cls, d: dict) -> "GptOssConfig":
        """config.json with transformers' GptOssConfig defaults where a checkpoint may leave a field out."""
        layout = moe_layout(mixtral_layout, d)          # the registry's reader of the layer and expert fields
        n_layers = len(layout.layer_ids)
        # each layer's attention (windowed or full), which the layout does not say
        types = per_layer(d, "layer_types", n_layers, LAYER_TYPES,
                          ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)])
        window = d.get("sliding_window", 128)
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ConfigError(f"config.sliding_window: must be an integer >= 1, got {window!r}")
        if window is None and "sliding_attention" in types:
            raise ConfigError("config.sliding_window: null, but layer_types has sliding_attention layers")
        limit = float(_get(d, "swiglu_limit", 7.0, (int, float)))
        if limit <= 0:
            raise ConfigError(f"config.swiglu_limit: must be > 0, got {limit}")
        rope_given = d.get("rope_scaling") is not None or d.get("rope_parameters") is not None
        # transformers' num_key_value_heads default, 8, fits no particular head count: a config must say it; its
        # head_dim default is 64, not hidden / heads
        return cls(
            **read_fields(d, cls, dict(vocab_size=REQUIRED, hidden_size=REQUIRED, intermediate_size=REQUIRED,
                                       num_attention_heads=REQUIRED, num_key_value_heads=REQUIRED, head_dim=64,
                                       rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                                       attention_bias=True, swiglu_alpha=1.702)),
            num_hidden_layers=n_layers,
            rope=read_rope(d if rope_given else dict(d, rope_parameters=DEFAULT_ROPE), default_theta=150000.0),
            num_experts=layout.n_routed, num_experts_per_tok=layout.top_k, sliding_window=window,
            layer_types=tuple(types), swiglu_limit=limit, moe_layers=layout.moe_layers)


class GptOssMoeBlock(nn.Module):
    """Router (bias; top-k on the logits, softmax over the K chosen) and the biased, clamped-SwiGLU experts."""

    def __init__(self, cfg: GptOssConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True, dtype=dtype)
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, plan,
                                     layer_id=layer_id, dtype=dtype, bias=True,
                                     activation=ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit))
        if self.experts.num_fused_shared_experts:
            raise ValueError(f"plan fuses {self.experts.num_fused_shared_experts} shared expert slot(s) but gpt-oss "
                             f"has no shared expert")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        logits = self.router(x)                                            # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)                  # [T, K]
        weights = torch.softmax(top, dim=-1)                               # [T, K]
        return self.experts(x, ids, weights)                               # reduced if the plan says


class GptOssDecoderLayer(BlockLayer):
    @classmethod
    def make_attention(cls, cfg: GptOssConfig, layer_id: int, dtype: torch.dtype, tp: TensorParallel) -> GQAttention:
        return GQAttention(AttentionSpec.of(cfg, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                                            sliding_window=window_of(cfg, layer_id), sinks=True), tp=tp, dtype=dtype)

    @classmethod
    def make_mlp(cls, cfg: GptOssConfig, plan, layer_id: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        return GptOssMoeBlock(cfg, plan, layer_id, dtype)


class GptOssForCausalLM(DeclaredCausalLM):
    ARCHITECTURE = ARCHITECTURE
    TENSOR_PARALLEL = True
    CONFIG = GptOssConfig
    DECODER_LAYER = GptOssDecoderLayer

    def checkpoint_view(self, ckpt):
        return StackedExperts(ckpt, self.config.num_experts, gate_up="interleaved")
