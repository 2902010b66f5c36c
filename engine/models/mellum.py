"""Mellum (`MellumForCausalLM`: JetBrains' MoE), following transformers' modeling_mellum numerically: Qwen3-MoE's layer
(models/qwen_moe.py: q/k RMSNorm per head, the softmax router's top-k renormalised) in a hybrid of windowed and global
layers.

- Attention: layer i is windowed ("sliding_attention": `sliding_window` positions) or global ("full_attention"), by
  `layer_types` (by default every layer global), each kind with its own rotary embedding (rope_parameters by layer
  type: transformers' defaults theta 5e5 global, 1e4 windowed), whole heads rotated.
- Layer i is MoE iff mlp_layer_types[i] is "sparse" (by default every layer); the dense ones a gated MLP of
  intermediate_size; the experts are moe_intermediate_size wide, no shared expert.
- Its Multi-Token-Prediction layer (`mtp.`, num_mtp_layers) is skipped, as transformers skips it. transformers saves
  the expert count as num_local_experts (num_experts is its alias).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loadplan.layouts import mellum_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.rope import RotaryEmbedding
from ..parallel.tensor import TensorParallel
from .config import ConfigError, Family, get_field as _get, per_layer, transformers_defaults
from .qwen_moe import QwenDecoderLayer, QwenLayerCausalLM, QwenMoeConfig
from .step3p5 import LAYER_TYPES, RopesByKind, rope_of_each_type

ARCHITECTURE = "MellumForCausalLM"
# transformers' default ropes, by layer type
DEFAULT_ROPES = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}


@dataclass(frozen=True)
class MellumConfig(QwenMoeConfig, RopesByKind):
    layer_types: tuple[str, ...] = ()
    ropes: tuple = ()


def _layer_kinds(d: dict, fields: dict) -> dict:
    """layer_types (by default every layer global), the window (null only without windowed layers) and the rope of
    each kind (whole heads rotated)."""
    n = fields.num_hidden_layers
    types = per_layer(d, "layer_types", n, LAYER_TYPES, ["full_attention"] * n)
    window = _get(d, "sliding_window", 1024, int) if d.get("sliding_window", 0) is not None else None
    if window is None and "sliding_attention" in types:
        raise ConfigError("config.sliding_window: null is not supported with sliding_attention layers")
    if window is not None and window < 1:
        raise ConfigError(f"config.sliding_window: must be >= 1, got {window}")
    ropes = rope_of_each_type(d.get("rope_parameters") or DEFAULT_ROPES, types, fields.head_dim)
    if any(rope.partial_rotary_factor != 1.0 for _, rope in ropes):
        raise ConfigError("config.rope_parameters: a partial_rotary_factor is not supported; Mellum rotates whole "
                          "heads")
    return dict(sliding_window=window, layer_types=tuple(types), ropes=ropes,
                rope=dict(ropes).get("full_attention", ropes[0][1]))


# transformers' MellumConfig defaults where a checkpoint may leave a field out.
MELLUM = Family(ARCHITECTURE, mellum_layout, dict(
    transformers_defaults(vocab_size=98304, hidden_size=2304, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, max_position_embeddings=131072),
    intermediate_size=7168, moe_intermediate_size=896, norm_topk_prob=True, qkv_bias=False),
    names={"qkv_bias": "attention_bias"}, rope=None, fixed={"o_bias": lambda f: f.qkv_bias, "qk_norm": True},
    own=(_layer_kinds,))


class MellumDecoderLayer(QwenDecoderLayer):
    """Qwen3-MoE's layer, windowed or not by its kind, turning q and k with its kind's rotary tables (`rotary`)."""

    @classmethod
    def make_attention(cls, cfg: MellumConfig, layer_id: int, dtype: torch.dtype, tp: TensorParallel) -> GQAttention:
        windowed = cfg.layer_types[layer_id] == "sliding_attention"
        return GQAttention(AttentionSpec.of(cfg, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm="head",
                                            sliding_window=cfg.sliding_window if windowed else None),
                           tp=tp, dtype=dtype)

    def __init__(self, cfg: MellumConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_of(cfg.layer_types[layer_id]), cfg.max_position_embeddings)


class MellumForCausalLM(QwenLayerCausalLM):
    ARCHITECTURE = ARCHITECTURE
    MTP_PREFIXES = ("mtp.",)
    FAMILY = MELLUM
    CONFIG = MellumConfig
    DECODER_LAYER = MellumDecoderLayer
