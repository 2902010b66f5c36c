"""FlexOlmo (`FlexOlmoForCausalLM`: AllenAI's FlexOlmo), following transformers' modeling_flex_olmo numerically.

Shapes: as qwen_moe.py (T tokens, D hidden, E experts, K top-k).

OLMoE's attention and MoE (models/olmoe.py: q and k each normalised by one RMSNorm over the whole projection,
the checkpoint's `self_attn.q_norm` / `k_norm`; every layer sparse, the router softmax -> top-k, renormalised only
with norm_topk_prob; no shared expert, so no fusion) in OLMo 2's post-norm layer: a block's input is not
normalised, its output is, before the residual sum:
    x = x + post_attention_layernorm(attn(x));  x = x + post_feedforward_layernorm(mlp(x))
No clip_qkv; the heads may be narrower than hidden_size / heads (`head_dim`). Every norm multiplies by its weight
before the cast back (`WeightFirstRMSNorm`), as transformers' FlexOlmoRMSNorm does.
"""

from __future__ import annotations

import torch

from loadplan.layouts import olmoe_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.norm import WeightFirstRMSNorm
from ..parallel.tensor import TensorParallel
from .causal_lm import DeclaredCausalLM, DecoderLayer
from .config import ConfigError, Family
from .olmoe import OLMOE_FIELDS, OLMOE_FIXED, OLMOE_NAMES
from .qwen_moe import QwenMoeConfig, QwenSparseMoeBlock

ARCHITECTURE = "FlexOlmoForCausalLM"


def _no_clip(d: dict, fields: dict) -> None:
    if d.get("clip_qkv") is not None:
        raise ConfigError(f"config.clip_qkv: {d['clip_qkv']!r} is not supported; FlexOlmo does not clip q, k, v")


# OLMoE's fields with transformers' FlexOlmoConfig defaults where a checkpoint may leave a field out.
FLEX_OLMO = Family(ARCHITECTURE, olmoe_layout, dict(OLMOE_FIELDS, rms_norm_eps=1e-6),
                   names={"qkv_bias": "attention_bias"}, rope={"default_theta": 10000.0}, fixed=OLMOE_FIXED,
                   own=(_no_clip,))


class FlexOlmoDecoderLayer(DecoderLayer):
    """x + post_attention_layernorm(attn(x)), then x + post_feedforward_layernorm(mlp(x))."""

    NORM = WeightFirstRMSNorm

    def __init__(self, cfg: QwenMoeConfig, plan, layer_id: int, dtype: torch.dtype):
        tp = TensorParallel.of(plan)   # heads split over the TP ranks (the experts: RoutedExperts)
        attn = GQAttention(AttentionSpec.of(cfg, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm="projection",
                                            norm=WeightFirstRMSNorm), tp=tp, dtype=dtype)
        super().__init__(layer_id, attn, QwenSparseMoeBlock(cfg, plan, layer_id, dtype), cfg.hidden_size,
                         cfg.rms_norm_eps, dtype)
        del self.input_layernorm                   # OLMo 2's layer normalises outputs, not inputs
        self.post_feedforward_layernorm = self.NORM(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x, cos, sin, input_pos=None):
        """x [B, T, D] -> [B, T, D]"""
        x = x + self.post_attention_layernorm(self.mixer(x, cos, sin, input_pos))
        B, T, D = x.shape
        return x + self.post_feedforward_layernorm(self.mlp(x.reshape(B * T, D))).view(B, T, D)


class FlexOlmoForCausalLM(DeclaredCausalLM):
    ARCHITECTURE = ARCHITECTURE
    TENSOR_PARALLEL = True
    CHECKPOINT_NAMES = OLMOE_NAMES
    DECODER_LAYER = FlexOlmoDecoderLayer

    FAMILY = FLEX_OLMO
    CONFIG = QwenMoeConfig
