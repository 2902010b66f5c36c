"""OLMoE (allenai/OLMoE-1B-7B), numerically following transformers' modeling_olmoe.

Shapes: as qwen_moe.py (T tokens, D hidden, E experts, K top-k).

An OLMoE layer is built by qwen_moe.py's layer from a `QwenMoeConfig` read off OLMoE's
config: GQA attention whose q and k are each normalised by ONE RMSNorm over the whole
projection (all heads together, not per head as in Qwen3), then clamped to +-clip_qkv
when set; every layer sparse, num_experts experts of width intermediate_size, the router
softmax -> top-k, renormalised only with norm_topk_prob (OLMoE ships false); no shared
expert. The checkpoint spells the projection norms `self_attn.q_norm` / `k_norm`; the
engine calls them `q_proj_norm` / `k_proj_norm` (`OLMOE_NAMES`) so that tensor parallelism
splits them with their heads and never splits Qwen3's per-head norms of the same name.
"""

from __future__ import annotations

from loadplan.layouts import olmoe_layout
from ..weights import CheckpointNames
from .config import ConfigError, Family, as_heads, heads_wide
from .qwen_moe import EXPERTS_AS_WIDE, MOE_FIELDS, QwenLayerCausalLM, QwenMoeConfig

ARCHITECTURE = "OlmoeForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}.
OLMOE_NAMES = CheckpointNames((
    ("self_attn.q_norm.weight", "self_attn.q_proj_norm.weight"),
    ("self_attn.k_norm.weight", "self_attn.k_proj_norm.weight"),
))


def _heads_span_hidden(d: dict, fields: dict) -> None:
    """transformers sizes q_norm by hidden_size and k_norm by (hidden_size // heads) * kv heads: the heads are
    hidden_size // heads wide, whatever a head_dim field says."""
    head_dim, heads, hidden = fields.head_dim, fields.num_attention_heads, fields.hidden_size
    if head_dim * heads != hidden:
        raise ConfigError(f"config.head_dim: {head_dim} x num_attention_heads={heads} must equal hidden_size={hidden} "
                          f"(OLMoE normalises q over hidden_size features)")
    clip = fields.clip_qkv
    if clip is not None and clip <= 0:
        raise ConfigError(f"config.clip_qkv: must be > 0 or null, got {clip}")


# transformers' OlmoeConfig defaults where a checkpoint may leave a field out (rms_norm_eps, rope theta, hidden_act,
# attention_bias, clip_qkv, norm_topk_prob); one attention_bias for q/k/v and o.
OLMOE_FIELDS = dict(MOE_FIELDS, rms_norm_eps=1e-5, max_position_embeddings=4096, num_key_value_heads=as_heads,
                    head_dim=heads_wide, norm_topk_prob=False, qkv_bias=False)
OLMOE_FIXED = dict(EXPERTS_AS_WIDE, o_bias=lambda f: f.qkv_bias, qk_norm=True, qk_norm_span="projection")
OLMOE = Family(ARCHITECTURE, olmoe_layout, dict(OLMOE_FIELDS, clip_qkv=None), names={"qkv_bias": "attention_bias"},
               rope={"default_theta": 10000.0}, fixed=OLMOE_FIXED, own=(_heads_span_hidden,))


def olmoe_config(d: dict) -> QwenMoeConfig:
    """OLMoE's config.json as the layer's config."""
    return OLMOE.read(d, QwenMoeConfig)


class OlmoeForCausalLM(QwenLayerCausalLM):
    ARCHITECTURE = ARCHITECTURE
    FAMILY = OLMOE
    CHECKPOINT_NAMES = OLMOE_NAMES
