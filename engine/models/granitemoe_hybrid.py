"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`: IBM's granite-4.0-h-tiny and -small), following transformers'
modeling_granitemoehybrid numerically.

Shapes: B batch, T tokens, D hidden, E experts, K top-k, V vocab.

GraniteMoeShared's layer (models/granitemoe.py: the four multipliers, softmax top-k experts and an ungated shared
MLP beside them, which the registry never fuses) whose token mixer is, by `layer_types`, either a Mamba2 state-space
layer (layers/mamba2.py, "mamba", transformers 5's "linear_attention") or attention ("attention" /
"full_attention"), rotated only with `position_embedding_type: "rope"` (the published models are NoPE).
Its checkpoints keep Granite MoE's stacked experts and shared MLP (GRANITE_NAMES) and the Mamba2 layers under
`mamba.*`, as the engine names them. Under tensor parallelism the attention and the experts split as Granite MoE's,
the shared MLP is replicated, and each Mamba2 layer holds its rank's heads (layers/mamba2.py: the checkpoint view
regroups its in_proj rows and conv channels rank by rank).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from loadplan.layouts import granitemoe_hybrid_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.mamba2 import Mamba2Mixer, Mamba2Spec, rows_by_rank
from ..parallel.tensor import TensorParallel
from .config import ConfigError, get_field as _get
from .granitemoe import GraniteMoeConfig, GraniteMoeDecoderLayer, GraniteMoeForCausalLM

ARCHITECTURE = "GraniteMoeHybridForCausalLM"
# Each layer's kind as configs spell it (transformers 5 writes the second spelling) -> the engine's.
LAYER_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}
POSITION_EMBEDDINGS = (None, "nope", "rope")


@dataclass(frozen=True)
class GraniteMoeHybridConfig(GraniteMoeConfig):
    layer_types: tuple[str, ...] = ()      # "mamba" / "attention" per layer
    use_rope: bool = False                 # position_embedding_type "rope"
    mamba_n_heads: int = 128
    mamba_d_head: int = 0
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)

    @classmethod
    def from_hf(cls, d: dict, architecture: str = ARCHITECTURE) -> "GraniteMoeHybridConfig":
        """transformers' GraniteMoeHybridConfig defaults where a checkpoint may leave a field out."""
        if d.get("shared_intermediate_size") is None:   # this family's default is 1024, not Granite MoE's 0
            d = dict(d, shared_intermediate_size=1024)
        # the registry's reader of the layer and expert fields, with this family's defaults (8 experts, top-2)
        base = GraniteMoeConfig.from_hf(d, architecture, reader=granitemoe_hybrid_layout)
        if base.hidden_act != "silu":   # the Mamba2 conv runs the config's activation; only SiLU is tested
            raise ConfigError(f"config.hidden_act: {base.hidden_act!r} not supported; Granite 4.0-H runs 'silu'")
        n, hidden = base.num_hidden_layers, base.hidden_size
        # each layer's token mixer, which the layout does not say
        field = "layer_types" if d.get("layer_types") is not None else "layers_block_type"
        kinds = d.get(field)
        if kinds is None:
            kinds = ["mamba"] * n   # transformers' default: every layer Mamba2
        if not isinstance(kinds, list) or len(kinds) != n or any(k not in LAYER_KINDS for k in kinds):
            raise ConfigError(f"config.{field}: expected {n} entries of {', '.join(LAYER_KINDS)}, got {kinds!r}"[:300])
        position = d.get("position_embedding_type")
        if position not in POSITION_EMBEDDINGS:
            raise ConfigError(f"config.position_embedding_type: {position!r} not supported; supported: "
                              f"{', '.join(map(repr, POSITION_EMBEDDINGS))}")
        heads = _get(d, "mamba_n_heads", 128, int)
        groups = _get(d, "mamba_n_groups", 1, int)
        expand = _get(d, "mamba_expand", 2, int)
        if heads < 1 or expand < 1 or (expand * hidden) % heads:
            raise ConfigError(f"config.mamba_n_heads: {heads} must be >= 1 and divide mamba_expand * hidden_size = "
                              f"{expand * hidden}")
        d_head = d.get("mamba_d_head", "auto")
        d_head = expand * hidden // heads if d_head in ("auto", None) else _get(d, "mamba_d_head", kind=int)
        if d_head * heads != expand * hidden:
            raise ConfigError(f"config.mamba_d_head: {d_head} x mamba_n_heads={heads} must be mamba_expand * "
                              f"hidden_size = {expand * hidden}")
        if groups < 1 or heads % groups:
            raise ConfigError(f"config.mamba_n_groups: {groups} must be >= 1 and divide mamba_n_heads={heads}")
        state, kernel = _get(d, "mamba_d_state", 256, int), _get(d, "mamba_d_conv", 4, int)
        if state < 1:
            raise ConfigError(f"config.mamba_d_state: must be >= 1, got {state}")
        if kernel < 1:
            raise ConfigError(f"config.mamba_d_conv: must be >= 1, got {kernel}")
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(GraniteMoeConfig)},
                   layer_types=tuple(LAYER_KINDS[k] for k in kinds), use_rope=position == "rope",
                   mamba_n_heads=heads, mamba_d_head=d_head, mamba_n_groups=groups, mamba_d_state=state,
                   mamba_d_conv=kernel, mamba_conv_bias=bool(_get(d, "mamba_conv_bias", True, bool)),
                   mamba_proj_bias=bool(_get(d, "mamba_proj_bias", False, bool)),
                   time_step_limit=_time_step_limit(d.get("time_step_limit", [0.0, math.inf])))


def _time_step_limit(value) -> tuple[float, float]:
    """[low, high] (null: unbounded), the bounds each position's dt is clamped to. transformers writes an infinite
    bound as {"__float__": "Infinity"}; the Hub's configs as Infinity (read by Python's json)."""
    if value is None:
        return (0.0, math.inf)
    bounds = [_FLOATS.get(v.get("__float__")) if isinstance(v, dict) and len(v) == 1 else v
              for v in (value if isinstance(value, (list, tuple)) else [value])]
    if len(bounds) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v)
                               for v in bounds) or not bounds[0] <= bounds[1]:
        raise ConfigError(f"config.time_step_limit: expected [low, high] with low <= high, got {value!r}"[:300])
    return (float(bounds[0]), float(bounds[1]))


_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf}


class GraniteMoeHybridDecoderLayer(GraniteMoeDecoderLayer):
    """Granite MoE's layer (with its shared MLP) whose token mixer is a Mamba2 layer or NoPE / rotary attention."""

    @classmethod
    def make_attention(cls, cfg: GraniteMoeHybridConfig, layer_id: int, dtype: torch.dtype, tp) -> GQAttention | None:
        if cfg.layer_types[layer_id] == "mamba":
            return None
        return GQAttention(AttentionSpec.of(cfg, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, use_rope=cfg.use_rope),
                           tp=tp, dtype=dtype)

    def __init__(self, cfg: GraniteMoeHybridConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        self.mamba = Mamba2Mixer(Mamba2Spec(cfg.hidden_size, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups,
                                            cfg.mamba_d_state, cfg.mamba_d_conv, cfg.mamba_conv_bias,
                                            cfg.mamba_proj_bias, cfg.rms_norm_eps, cfg.time_step_limit),
                                 tp=TensorParallel.of(plan), dtype=dtype) \
            if cfg.layer_types[layer_id] == "mamba" else None

    @property
    def mixer(self):
        return self.mamba if self.mamba is not None else self.self_attn


class GraniteMoeHybridForCausalLM(GraniteMoeForCausalLM):
    ARCHITECTURE = ARCHITECTURE
    CONFIG = GraniteMoeHybridConfig
    DECODER_LAYER = GraniteMoeHybridDecoderLayer

    def checkpoint_view(self, ckpt):
        """Granite MoE's view, over the Mamba2 layers' rows regrouped by TP rank (when tp_size > 1)."""
        tp, cfg = self.plan.request.parallel.tp_size, self.config
        if tp > 1:
            ckpt = rows_by_rank(ckpt, [f"model.layers.{i}.mamba." for i, kind in enumerate(cfg.layer_types)
                                       if kind == "mamba"],
                                tp, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups, cfg.mamba_d_state)
        return super().checkpoint_view(ckpt)
