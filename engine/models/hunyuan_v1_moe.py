"""Hunyuan MoE (`HunYuanMoEV1ForCausalLM`: Tencent's Hunyuan-A13B), following transformers' modeling_hunyuan_v1_moe
numerically.

Shapes: B batch, T tokens, D hidden, E experts, K top-k, V vocab.

Built from qwen_moe.py's layer (every layer sparse) with three differences:
- attention: GQA whose per-head q and k RMSNorms (the checkpoint's `query_layernorm` / `key_layernorm`) run on q
  and k AFTER the rotary embedding (`qk_norm_after_rope`);
- RoPE: the Hub's configs say `"type": "dynamic"` with an `alpha`, which transformers reads as a fixed NTK stretch
  of the base, theta * alpha ** (d / (d - 2)) (layers/rope.py's "ntk_alpha");
- MoE: the router (`mlp.gate.wg`) is float32 and scores float32 inputs; softmax, top-k, renormalised; an ungated
  shared MLP (`mlp.shared_mlp`, as wide as an expert) is added to the experts' output (`SharedMlpMoeBlock`),
  never fused (the registry's gate).

The Hub's config.json says some fields per layer (`moe_topk`, `num_experts`, `moe_intermediate_size`,
`num_shared_expert`: lists) and carries switches for variants transformers does not build (cross-layer attention,
MLA, no qk norm, no shared MLP). transformers sizes every expert and the shared MLP by `intermediate_size` and
takes one expert count and top-k: a config is run where it says the same, and refused by field where it does not.
"""

from __future__ import annotations

from loadplan.layouts import hunyuan_v1_moe_layout
from ..weights import CheckpointNames
from .causal_lm import DeclaredCausalLM
from .config import ConfigError, Family, as_heads, get_field as _get, heads_wide
from .qwen_moe import EXPERTS_AS_WIDE, MOE_FIELDS, Float32RouterMoeBlock, QwenDecoderLayer, QwenMoeConfig

ARCHITECTURE = "HunYuanMoEV1ForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}.
HUNYUAN_NAMES = CheckpointNames((
    ("self_attn.query_layernorm.weight", "self_attn.q_norm.weight"),
    ("self_attn.key_layernorm.weight", "self_attn.k_norm.weight"),
    ("mlp.gate.wg.weight", "mlp.gate.weight"),
))

# Switches of Tencent's own modeling code whose variants transformers does not build: (field, the value it runs).
# (use_mixed_mlp_moe, its shared MLP's switch, is the registry's reader's: it refuses false.)
_VARIANT_SWITCHES = (("use_qk_norm", True), ("use_cla", False), ("use_mla", False), ("mlp_bias", False),
                     ("norm_topk_prob", True))


def one_per_model(d: dict, name: str, n_layers: int, default=None) -> int | None:
    """`name`, an integer or a list of one integer per layer that all agree (the Hub's Hunyuan configs write
    `moe_intermediate_size` per layer, as the expert fields the registry's layout reads); `default` when absent."""
    value = d.get(name)
    if value is None:
        return default
    if isinstance(value, list):
        if len(value) != n_layers or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise ConfigError(f"config.{name}: expected an integer or {n_layers} integers (one per layer), "
                              f"got {value!r}"[:300])
        if len(set(value)) != 1:
            raise ConfigError(f"config.{name}: per-layer values {sorted(set(value))} differ; the engine (as "
                              f"transformers) builds every layer alike")
        return value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.{name}: expected an integer or a list of integers, got {value!r}"[:300])
    return value


def _as_transformers_builds(d: dict, fields: dict) -> dict:
    """The variants transformers does not build refused by field; every layer MoE, the experts as wide as the
    shared MLP (intermediate_size); the heads' width (head_dim, else attention_head_dim)."""
    for name, runs in _VARIANT_SWITCHES:
        if name in d and d[name] is not None and d[name] != runs:
            raise ConfigError(f"config.{name}: {d[name]!r} is not supported; the engine (as transformers) runs "
                              f"{name}={runs!r} only")
    skipped = _get(d, "moe_layer_num_skipped", 0, int)
    if skipped:
        raise ConfigError(f"config.moe_layer_num_skipped: {skipped} is not supported; every layer is MoE")
    width = fields.intermediate_size
    expert_width = one_per_model(d, "moe_intermediate_size", fields.num_hidden_layers, width)
    if expert_width != width:
        raise ConfigError(f"config.moe_intermediate_size: {expert_width} differs from intermediate_size={width}, "
                          f"which sizes the experts and the shared MLP (as in transformers)")
    return {"head_dim": _get(d, "head_dim", None, int) or _get(d, "attention_head_dim", heads_wide(fields), int)}


# transformers' HunYuanMoEV1Config defaults where a checkpoint may leave a field out. The registry's reader of the
# layer and expert fields reads num_experts, moe_topk and num_shared_expert (each an integer or per-layer values that
# agree): every layer MoE, with one shared MLP. Its NTK-alpha is this family's reading of the rotary fields.
HUNYUAN = Family(ARCHITECTURE, hunyuan_v1_moe_layout, dict(
    MOE_FIELDS, rms_norm_eps=1e-5, max_position_embeddings=2048, num_key_value_heads=as_heads, qkv_bias=False),
    names={"qkv_bias": "attention_bias"}, rope={"default_theta": 10000.0, "ntk_alpha": True},
    fixed=dict(EXPERTS_AS_WIDE, shared_intermediate_size=lambda f: f.intermediate_size, norm_topk_prob=True,
               o_bias=lambda f: f.qkv_bias, qk_norm=True, qk_norm_after_rope=True),
    own=(_as_transformers_builds,))


class HunyuanDecoderLayer(QwenDecoderLayer):
    MOE_BLOCK = Float32RouterMoeBlock   # transformers keeps the router's weight float32, scoring float32 inputs


class HunYuanMoEV1ForCausalLM(DeclaredCausalLM):
    ARCHITECTURE = ARCHITECTURE
    TENSOR_PARALLEL = True
    CHECKPOINT_NAMES = HUNYUAN_NAMES
    FAMILY = HUNYUAN
    CONFIG = QwenMoeConfig
    DECODER_LAYER = HunyuanDecoderLayer
