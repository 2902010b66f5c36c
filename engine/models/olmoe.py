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
from .config import ConfigError, get_field as _get, moe_layout, read_rope
from .qwen_moe import QwenLayerCausalLM, QwenMoeConfig, moe_fields

ARCHITECTURE = "OlmoeForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}.
OLMOE_NAMES = CheckpointNames((
    ("self_attn.q_norm.weight", "self_attn.q_proj_norm.weight"),
    ("self_attn.k_norm.weight", "self_attn.k_proj_norm.weight"),
))


def olmoe_config(d: dict) -> QwenMoeConfig:
    """OLMoE's config.json as the layer's config; transformers' OlmoeConfig defaults where a checkpoint may
    leave a field out (rms_norm_eps, rope theta, hidden_act, attention_bias, clip_qkv, norm_topk_prob)."""
    common = moe_fields(d, moe_layout(olmoe_layout, d), rms_norm_eps=1e-5, max_position_embeddings=4096,
                        rope=read_rope(d, default_theta=10000.0))
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    # transformers sizes q_norm by hidden_size and k_norm by (hidden_size // heads) * kv heads: the heads
    # are hidden_size // heads wide, whatever a head_dim field says.
    head_dim = _get(d, "head_dim", hidden // heads, int)
    if head_dim * heads != hidden:
        raise ConfigError(f"config.head_dim: {head_dim} x num_attention_heads={heads} must equal hidden_size={hidden} "
                          f"(OLMoE normalises q over hidden_size features)")
    clip = _get(d, "clip_qkv", None, (int, float))
    if clip is not None and clip <= 0:
        raise ConfigError(f"config.clip_qkv: must be > 0 or null, got {clip}")
    bias = bool(_get(d, "attention_bias", False, bool))
    return QwenMoeConfig(
        architecture=ARCHITECTURE,
        **common,
        num_key_value_heads=_get(d, "num_key_value_heads", heads, int),
        head_dim=head_dim,
        norm_topk_prob=bool(_get(d, "norm_topk_prob", False, bool)),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        qk_norm_span="projection",
        clip_qkv=None if clip is None else float(clip),
    )


class OlmoeForCausalLM(QwenLayerCausalLM):
    ARCHITECTURE = ARCHITECTURE
    CHECKPOINT_NAMES = OLMOE_NAMES

    @classmethod
    def parse_config(cls, hf_config: dict) -> QwenMoeConfig:
        return olmoe_config(hf_config)
