"""Kimi-Linear (`KimiLinearForCausalLM`: Moonshot's Kimi-Linear-48B-A3B), following transformers'
modeling_kimi_linear.py numerically.

Shapes: B batch, T tokens, D hidden, E routed experts. A hybrid: most layers mix tokens with Kimi Delta Attention
(layers/kimi_delta_attention.py: a recurrent state with a decay per channel, no KV cache), the others with
DeepSeek's Multi-head Latent Attention WITHOUT rotary embedding (layers/mla.py, `use_rope=False`: the
qk_rope_head_dim features are one shared key head, not rotated). The MLP is DeepSeek-V3's (deepseek_v3.py):
dense on the first first_k_dense_replace layers (or where mlp_layer_types says "dense"), else the sigmoid router
with e_score_correction_bias and group-limited top-k over num_experts routed experts, and num_shared_experts
shared ones beside them, never fused (our choice: the registry's kimi_linear gate).

Its config.json has its own names (transformers' attribute map): num_experts, num_experts_per_token,
num_shared_experts, num_expert_group, moe_renormalize, model_max_length; its layers' kinds under
linear_attn_config (kda_layers / full_attn_layers, counted from 1), as transformers reads them. Its checkpoints
keep the MoE block as `block_sparse_moe` with Mixtral's expert names (`KIMI_LINEAR_NAMES`); the dense layers'
MLP is `mlp` on the Hub and `block_sparse_moe` as transformers saves it: both read.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from loadplan.layouts import kimi_linear_layout
from ..layers.kimi_delta_attention import KimiDeltaAttention
from ..layers.mla import MLASpec, MultiHeadLatentAttention
from ..parallel.tensor import TensorParallel
from ..shown_tensors import ShownTensors
from ..weights import CheckpointNames
from .config import ConfigError, get_field as _get, moe_layout, per_layer
from .deepseek_v3 import DeepseekMoeLayer, DeepseekV3Config, LatentCausalLM
from .mixtral import MIXTRAL_NAMES

ARCHITECTURE = "KimiLinearForCausalLM"
LAYER_TYPES = ("linear_attention", "full_attention")

# (checkpoint, engine) suffixes under model.layers.{i}.
KIMI_LINEAR_NAMES = CheckpointNames((
    *MIXTRAL_NAMES.pairs,                  # the router and the routed experts, as Mixtral spells them
    ("block_sparse_moe.gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
    *((f"block_sparse_moe.{mlp}{proj}_proj.weight", f"mlp.{mlp}{proj}_proj.weight")
      for mlp in ("shared_experts.", "") for proj in ("gate", "up", "down")),
))

# (Hub / transformers name, DeepSeek-V3's name, transformers' KimiLinearConfig default) of the fields the layout
# does not give (its expert counts and top-k: the registry's kimi_linear_layout reads them under either name).
RENAMED = (
    ("num_expert_group", "n_group", 1),
    ("moe_renormalize", "norm_topk_prob", True),
    ("model_max_length", "max_position_embeddings", 1048576),
)
# transformers' KimiLinearConfig defaults of the fields DeepSeek-V3's config reads without one (or another one).
DEFAULTS = dict(routed_scaling_factor=2.446, rms_norm_eps=1e-5, kv_lora_rank=512, qk_rope_head_dim=64,
                qk_nope_head_dim=128, v_head_dim=128, topk_group=1)
# Fields of later Kimi models (Kimi-K3's text model shares the model_type) that transformers' Kimi-Linear does
# not run: refused where they would change the arithmetic, (field, the value that changes nothing).
NOT_RUN = (("mla_use_nope", True), ("mla_use_output_gate", False), ("attn_res_block_size", None),
           ("moe_layer_freq", 1), ("moe_router_activation_func", "sigmoid"), ("latent_moe_use_norm", None),
           ("routed_expert_hidden_size", None))
LINEAR_NOT_RUN = (("gate_lower_bound", None), ("use_full_rank_gate", False))


@dataclass(frozen=True)
class KimiLinearConfig(DeepseekV3Config):
    layer_types: tuple[str, ...] = ()
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4

    @classmethod
    def from_hf(cls, d: dict, architecture: str = ARCHITECTURE) -> "KimiLinearConfig":
        linear = d.get("linear_attn_config") or {}
        if not isinstance(linear, dict):
            raise ConfigError(f"config.linear_attn_config: expected an object, got {linear!r}"[:200])
        for field, harmless in NOT_RUN:
            if d.get(field, harmless) != harmless:
                raise ConfigError(f"config.{field}: {d[field]!r} not supported; Kimi-Linear runs {harmless!r}"[:200])
        for field, harmless in LINEAR_NOT_RUN:
            if linear.get(field, harmless) != harmless:
                raise ConfigError(f"config.linear_attn_config.{field}: {linear[field]!r} not supported; Kimi-Linear "
                                  f"runs {harmless!r}"[:200])
        layout = moe_layout(kimi_linear_layout, d)       # the registry's reader of the layer and expert fields
        # no rope: the MLA is NoPE
        ds = deepseek_fields_renamed({k: v for k, v in d.items() if k not in ("rope_parameters", "rope_scaling",
                                                                               "rope_theta")}, layout, RENAMED,
                                     DEFAULTS)
        return cls(**{f.name: getattr(ds, f.name) for f in dataclasses.fields(DeepseekV3Config)
                      if f.name != "tie_word_embeddings"},
                   # transformers' Kimi-Linear ties no head whatever the config says (its checkpoints keep lm_head)
                   tie_word_embeddings=False,
                   layer_types=tuple(_layer_types(d, linear, ds.num_hidden_layers)),
                   linear_num_heads=_linear_field(d, linear, "num_heads", "linear_num_heads", 32),
                   linear_head_dim=_linear_field(d, linear, "head_dim", "linear_head_dim", 128),
                   linear_conv_kernel_dim=_linear_field(d, linear, "short_conv_kernel_size", "linear_conv_kernel_dim",
                                                        4))


def deepseek_fields_renamed(d: dict, layout, renamed: tuple, defaults: dict) -> DeepseekV3Config:
    """DeepSeek-V3's config of a family that names its fields otherwise: its layers, MoE layers, expert counts and
    top-k those of `layout` (the registry's reading of `d`, `moe_layout`), its other fields by `renamed` ((its name,
    DeepSeek's, default)) with the family's `defaults`; refusals name the fields as the config spells them. SiLU
    only: the KDA layers' conv runs the config's activation too, and transformers' Kimi-Linear and Ling models run
    SiLU."""
    act = _get(d, "hidden_act", "silu", str)
    if act != "silu":
        raise ConfigError(f"config.hidden_act: {act!r} not supported; supported: 'silu'")
    named = dict(d)
    for ours, deepseek, default in renamed:
        named[deepseek] = d[ours] if d.get(ours) is not None else d.get(deepseek, default)
    for field, default in defaults.items():
        named.setdefault(field, default)
    try:
        return DeepseekV3Config.from_layout(named, layout, "DeepseekV3ForCausalLM")
    except ConfigError as e:   # name the fields as this config spells them
        message = str(e)
        for ours, deepseek, _ in renamed:
            if d.get(ours) is not None:
                message = re.sub(rf"\b{deepseek}\b", ours, message)
        raise ConfigError(message) from None


def _linear_field(d: dict, linear: dict, name: str, flat: str, default: int) -> int:
    """A KDA size: linear_attn_config's (the Hub's), else the top-level field transformers saves, else its default."""
    if linear.get(name) is not None:
        value, field = linear[name], f"linear_attn_config.{name}"
    else:
        value, field = _get(d, flat, default, int), flat
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config.{field}: expected a positive int, got {value!r}")
    return value


def _layer_types(d: dict, linear: dict, n: int) -> list[str]:
    """Each layer's kind, as transformers' KimiLinearConfig derives it: `layer_types`, else linear_attn_config's
    kda_layers / full_attn_layers (counted from 1; together every layer once), else every 4th layer but the first
    full attention."""
    if d.get("layer_types") is not None:
        return per_layer(d, "layer_types", n, LAYER_TYPES, [])
    kda, full = linear.get("kda_layers"), linear.get("full_attn_layers")
    if kda is None or full is None:
        return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    for field, ids in (("kda_layers", kda), ("full_attn_layers", full)):
        if not isinstance(ids, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
            raise ConfigError(f"config.linear_attn_config.{field}: expected a list of layer numbers, got {ids!r}"[:200])
    if sorted(kda + full) != list(range(1, n + 1)):
        raise ConfigError(f"config.linear_attn_config.kda_layers: with full_attn_layers, must number each of the "
                          f"{n} layers once, from 1; got {sorted(kda)} and {sorted(full)}"[:300])
    kinds = set(full)
    return ["full_attention" if i + 1 in kinds else "linear_attention" for i in range(n)]


class KimiLinearDecoderLayer(DeepseekMoeLayer):
    @classmethod
    def make_attention(cls, cfg: KimiLinearConfig, layer_id: int, dtype: torch.dtype, tp: TensorParallel):
        if cfg.layer_types[layer_id] == "linear_attention":
            return KimiDeltaAttention(cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim,
                                      cfg.linear_conv_kernel_dim, cfg.rms_norm_eps, dtype, tp)
        return MultiHeadLatentAttention(MLASpec.of(cfg, use_rope=False), tp=tp, dtype=dtype)


class KimiLinearForCausalLM(LatentCausalLM):
    ARCHITECTURE = ARCHITECTURE
    CHECKPOINT_NAMES = KIMI_LINEAR_NAMES
    CONFIG = KimiLinearConfig
    DECODER_LAYER = KimiLinearDecoderLayer

    def checkpoint_view(self, ckpt):
        """The checkpoint with each KDA layer's A_log, which it holds as [1, 1, H, 1], shown as the layer's [H] (any
        other shape is shown as it is, and refused by the shape check)."""
        view = ShownTensors(ckpt)
        for name in ckpt.names():
            shape = tuple(ckpt.shape(name))
            if name.endswith(".self_attn.A_log") and len(shape) == 4 and shape[:2] == (1, 1) and shape[3] == 1:
                view.show(name, name, (shape[2],), lambda t: t.reshape(-1))
            else:
                view.show(name, name)
        return view
