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

from dataclasses import dataclass

from loadplan.layouts import hunyuan_v1_moe_layout
from ..weights import CheckpointNames
from .causal_lm import DeclaredCausalLM
from .config import ConfigError, get_field as _get, moe_layout, read_rope
from .qwen_moe import Float32RouterMoeBlock, QwenDecoderLayer, QwenMoeConfig, moe_fields

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


@dataclass(frozen=True)
class HunyuanMoeConfig(QwenMoeConfig):
    @classmethod
    def from_hf(cls, d: dict, architecture: str = ARCHITECTURE) -> "HunyuanMoeConfig":
        """transformers' HunYuanMoEV1Config defaults where a checkpoint may leave a field out."""
        for name, runs in _VARIANT_SWITCHES:
            if name in d and d[name] is not None and d[name] != runs:
                raise ConfigError(f"config.{name}: {d[name]!r} is not supported; the engine (as transformers) runs "
                                  f"{name}={runs!r} only")
        # The registry's reader of the layer and expert fields (num_experts, moe_topk and num_shared_expert, each
        # an integer or per-layer values that agree): every layer MoE, with one shared MLP.
        layout = moe_layout(hunyuan_v1_moe_layout, d)
        n_layers = len(layout.layer_ids)
        skipped = _get(d, "moe_layer_num_skipped", 0, int)
        if skipped:
            raise ConfigError(f"config.moe_layer_num_skipped: {skipped} is not supported; every layer is MoE")
        width = _get(d, "intermediate_size", kind=int)
        expert_width = one_per_model(d, "moe_intermediate_size", n_layers, width)
        if expert_width != width:
            raise ConfigError(f"config.moe_intermediate_size: {expert_width} differs from intermediate_size={width}, "
                              f"which sizes the experts and the shared MLP (as in transformers)")
        # its NTK-alpha is this family's reading of the rotary fields
        common = moe_fields(d, layout, rms_norm_eps=1e-5, max_position_embeddings=2048,
                            rope=read_rope(d, default_theta=10000.0, ntk_alpha=True))
        hidden, heads = common["hidden_size"], common["num_attention_heads"]
        head_dim = _get(d, "head_dim", None, int) or _get(d, "attention_head_dim", hidden // heads, int)
        bias = bool(_get(d, "attention_bias", False, bool))
        return cls(
            architecture=architecture,
            **common,
            num_key_value_heads=_get(d, "num_key_value_heads", heads, int),
            head_dim=head_dim,
            norm_topk_prob=True,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            qk_norm_after_rope=True,
            shared_intermediate_size=width,
        )


class HunyuanDecoderLayer(QwenDecoderLayer):
    MOE_BLOCK = Float32RouterMoeBlock   # transformers keeps the router's weight float32, scoring float32 inputs


class HunYuanMoEV1ForCausalLM(DeclaredCausalLM):
    ARCHITECTURE = ARCHITECTURE
    TENSOR_PARALLEL = True
    CHECKPOINT_NAMES = HUNYUAN_NAMES
    CONFIG = HunyuanMoeConfig
    DECODER_LAYER = HunyuanDecoderLayer
