"""Step-3.5 (`Step3p5ForCausalLM`: StepFun's Step-3.5-Flash, and the text model of Step-3.7-Flash), following
transformers' Step3p7TextModel (modeling_step3p7) numerically.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads, hd head_dim.

- Norms: Gemma's RMSNorm, weights stored as offsets from 1 (layers/norm.py's OffsetRMSNorm), on the layers, the
  final norm and each head of q and k (before the rotation).
- Attention: grouped-query; layer i is windowed ("sliding_attention": `sliding_window` positions and
  num_sliding_attention_heads query heads) or global ("full_attention": num_attention_heads), by `layer_types`.
  Each kind has its own rotary embedding (rope_parameters by layer type: theta and the rotated fraction of each head,
  whose first features are rotated). The output is gated by sigmoid(g_proj(x)), one gate a head (`gating` true or
  "per-head"; a gate a feature is refused: transformers' Step-3.7 cannot run it either). The softmax scale is
  query_pre_attn_scalar ** -0.5 (head_dim by default).
- Layer i is MoE iff mlp_layer_types[i] is "sparse" (by default every layer from the fourth). MoE: a sigmoid router
  whose top-k is chosen with a routing bias (the checkpoint's `moe.router_bias`) and weighted by the scores alone,
  renormalised and scaled by moe_router_scaling_factor: DeepSeek-V3's router, one group (layers/deepseek_router.py);
  n_routed_experts experts of moe_intermediate_size, and one shared expert of share_expert_dim added to them, which
  the registry never fuses (our choice: its width is its own).
- SwiGLU clamps: where `swiglu_limits[i]` is set, layer i's routed experts clamp their gate activation above and their
  up projection both ways at it; `swiglu_limits_shared[i]` does the same for the layer's shared expert, or its dense
  MLP (0 or null: no clamp).
- Checkpoints (the Hub's spelling, which transformers' save keeps): each layer's experts stacked, `moe.gate_proj` /
  `moe.up_proj` [E, I, D] and `moe.down_proj` [E, D, I], shown one expert at a time; `moe.gate` the router,
  `share_expert` the shared expert, `self_attn.g_proj` the output gate. Its Multi-Token-Prediction layers
  (num_nextn_predict_layers, after the last layer) are skipped, and the per-layer lists that cover them are cut to the
  model's layers, as transformers reads them.
- transformers runs SiLU whatever hidden_act says; so does the engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loadplan.layouts import step3p5_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.deepseek_router import DeepseekV3Router, RouterSpec
from ..layers.mlp import GatedMLP
from ..layers.norm import OffsetRMSNorm
from ..layers.rope import RopeConfig, RotaryEmbedding, rope_config_from_hf
from ..moe import RoutedExperts
from ..parallel.tensor import TensorParallel
from ..shown_tensors import ShownTensors
from ..weights import CheckpointNames
from .causal_lm import DeclaredCausalLM, DecoderLayer
from .config import ConfigError, DecoderConfig, get_field as _get, moe_layout, per_layer, read_fields

ARCHITECTURE = "Step3p5ForCausalLM"
LAYER_TYPES = ("full_attention", "sliding_attention")

# (checkpoint, engine) suffixes under model.layers.{i}.
STEP3P5_NAMES = CheckpointNames((
    ("moe.gate.weight", "mlp.gate.weight"),
    ("moe.router_bias", "mlp.gate.e_score_correction_bias"),
    ("self_attn.g_proj.weight", "self_attn.gate_proj.weight"),
    *((f"share_expert.{p}.weight", f"mlp.shared_experts.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")),
))
# Step-3.5-Flash's config.json switches that transformers leaves unread, and the only values its model has: another
# value would change the arithmetic, so it is refused by field rather than ignored.
FIXED_FIELDS = {"use_moe": True, "moe_router_activation": "sigmoid", "use_moe_router_bias": True,
                "norm_expert_weight": True, "use_qk_norm": True, "use_head_wise_attn_gate": True, "zero_centered": True,
                "sink": False, "att_impl_type": "GQA", "use_rope_layers": [], "yarn_only_types": ["full_attention"]}
# A layer's stacked experts: model.layers.{i}.moe.{gate,up,down}_proj.weight, [E, I, D] / [E, D, I]
_STACKED = re.compile(r"^(?P<layer>.*model\.layers\.\d+)\.moe\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class RopesByKind:
    """A config whose layer kinds each turn q and k with a rope of their own (`ropes`: (kind, rope) pairs)."""

    ropes: tuple[tuple[str, RopeConfig], ...]

    def rope_of(self, layer_type: str) -> RopeConfig:
        return dict(self.ropes)[layer_type]


@dataclass(frozen=True)
class Step3p5Config(DecoderConfig, RopesByKind):
    intermediate_size: int               # the dense layers' MLP
    num_attention_heads: int             # the global layers'
    num_sliding_attention_heads: int     # the windowed layers'
    num_key_value_heads: int
    head_dim: int
    # rope: the global layers' (each layer turns q and k with its kind's: `ropes`)
    ropes: tuple[tuple[str, RopeConfig], ...]
    layer_types: tuple[str, ...]
    sliding_window: int | None
    attention_bias: bool
    attention_scale: float
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    share_expert_dim: int
    routed_scaling_factor: float
    moe_layers: tuple[int, ...]
    swiglu_limits: tuple[float | None, ...]          # per layer: the routed experts' clamp
    swiglu_limits_shared: tuple[float | None, ...]   # per layer: the shared expert's or dense MLP's clamp
    num_nextn_predict_layers: int = 0

    @classmethod
    def from_hf(cls, d: dict) -> "Step3p5Config":
        """transformers' Step3p7TextConfig defaults, and its readings of the Hub's older fields
        (attention_other_setting, rope_theta and partial_rotary_factors per layer), where a checkpoint gives them; the
        layers and experts as the registry reads them (layouts.step3p5_layout: moe_layers_enum included)."""
        for name, value in FIXED_FIELDS.items():
            if name in d and d[name] != value:
                raise ConfigError(f"config.{name}: {d[name]!r} is not supported; Step-3.5 runs {value!r}"[:300])
        if d.get("use_bidirectional_attention"):
            raise ConfigError("config.use_bidirectional_attention: true is not supported; the engine runs Step-3.5 "
                              "causally")
        if d.get("mlp_bias"):
            raise ConfigError("config.mlp_bias: true is not supported; Step-3.5's released MLPs have no bias")
        layout = moe_layout(step3p5_layout, d)          # the registry's reader of the layer and expert fields
        n = len(layout.layer_ids)
        # The MTP layers' count, which the layout does not give: the per-layer lists that also cover them are cut.
        mtp = _get(d, "num_nextn_predict_layers", None, int)
        mtp = _get(d, "num_mtp_layers", 0, int) if mtp is None else mtp
        cut = _PerLayerCut(d, n, n + mtp)
        types = per_layer(cut, "layer_types", n, LAYER_TYPES, ["full_attention"] * n)
        hidden = _get(d, "hidden_size", 4096, int)
        heads = _get(d, "num_attention_heads", 64, int)
        head_dim = _get(d, "head_dim", 128, int)
        window = _get(d, "sliding_window", None, int)
        if window is None and "sliding_attention" in types:
            raise ConfigError("config.sliding_window: null is not supported with sliding_attention layers")
        if window is not None and window < 1:
            raise ConfigError(f"config.sliding_window: must be >= 1, got {window}")
        gating = d.get("gating", True)
        if gating not in (True, "per-head"):
            raise ConfigError(f"config.gating: {gating!r} is not supported; true or \"per-head\" (a gate a head: "
                              f"transformers' Step-3.7 runs no other)")
        scalar = _get(d, "query_pre_attn_scalar", head_dim, (int, float))
        if scalar <= 0:
            raise ConfigError(f"config.query_pre_attn_scalar: must be > 0, got {scalar}")
        ropes = _ropes(d, cut, types, head_dim)
        return cls(
            **read_fields(d, cls, dict(vocab_size=128815, intermediate_size=11264, rms_norm_eps=1e-5,
                                       max_position_embeddings=128000, tie_word_embeddings=False, attention_bias=False,
                                       moe_intermediate_size=1280, routed_scaling_factor=1.0),
                          names=dict(routed_scaling_factor="moe_router_scaling_factor")),
            hidden_size=hidden, num_hidden_layers=n, num_attention_heads=heads,
            num_sliding_attention_heads=_sliding_heads(d, heads, types),
            num_key_value_heads=_first_of(d, ("num_key_value_heads", "num_attention_groups"), 8), head_dim=head_dim,
            rope=dict(ropes).get("full_attention", ropes[0][1]), ropes=ropes, layer_types=tuple(types),
            sliding_window=window, attention_scale=float(scalar) ** -0.5, num_experts=layout.n_routed,
            num_experts_per_tok=layout.top_k,
            share_expert_dim=_first_of(d, ("share_expert_dim", "share_expert_dims"), 1280),
            moe_layers=layout.moe_layers, swiglu_limits=_limits(cut, "swiglu_limits", n),
            swiglu_limits_shared=_limits(cut, "swiglu_limits_shared", n), num_nextn_predict_layers=mtp)


class _PerLayerCut(dict):
    """config.json with its per-layer lists cut to the model's `n` layers where they also cover its `padded - n` MTP
    layers (the Hub's files pad layer_types, mlp_layer_types, swiglu_limits and the like with the MTP layers')."""

    def __init__(self, d: dict, n: int, padded: int):
        super().__init__(d)
        for name, value in d.items():
            if padded > n and isinstance(value, list) and len(value) == padded:
                self[name] = value[:n]


def _first_of(d: dict, names: tuple[str, ...], default: int) -> int:
    """The first of `names` the config gives (a field and its older spellings), else `default`."""
    name = next((x for x in names if d.get(x) is not None), names[0])
    return _get(d, name, default, int)


def _sliding_heads(d: dict, heads: int, types: list[str]) -> int:
    """num_sliding_attention_heads, else the older attention_other_setting's num_attention_heads, else the global
    layers' count; a per_layer_config (transformers' save writes one) must say the same for every windowed layer."""
    value = d.get("num_sliding_attention_heads")
    if value is None:
        other = d.get("attention_other_setting") or {}
        value = other.get("num_attention_heads", heads) if isinstance(other, dict) else heads
        field = "attention_other_setting.num_attention_heads"
    else:
        field = "num_sliding_attention_heads"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.{field}: expected a positive integer, got {value!r}")
    per_layer_config = d.get("per_layer_config") or {}
    for layer, override in per_layer_config.items():
        i = int(layer) if str(layer).isdigit() else -1
        want = {"num_attention_heads": value if 0 <= i < len(types) and types[i] == "sliding_attention" else heads}
        if override != want:
            raise ConfigError(f"config.per_layer_config.{layer}: {override!r} is not supported; the engine runs "
                              f"{want!r} there (num_sliding_attention_heads on windowed layers only)"[:300])
    return value


def _ropes(d: dict, cut: dict, types: list[str], head_dim: int) -> tuple[tuple[str, RopeConfig], ...]:
    """One rope per layer type: rope_parameters by layer type, else built as transformers builds it from rope_theta
    and partial_rotary_factors (a value, or one per layer: the first layer of each type's), rope_scaling joining the
    global layers'."""
    params = d.get("rope_parameters")
    kinds = sorted(set(types))
    if not (isinstance(params, dict) and all(isinstance(params.get(t), dict) for t in kinds)):
        theta, factors = cut.get("rope_theta", 10000.0), cut.get("partial_rotary_factors")
        params = {}
        for t in kinds:
            i = types.index(t)
            params[t] = {"rope_type": "default", "rope_theta": theta[i] if isinstance(theta, list) else theta}
            if factors:
                params[t]["partial_rotary_factor"] = factors[i] if isinstance(factors, list) else factors
        if d.get("rope_scaling") and "full_attention" in params:
            params["full_attention"].update(d["rope_scaling"])
    return rope_of_each_type(params, types, head_dim)


def rope_of_each_type(params: dict, types: list[str], head_dim: int) -> tuple[tuple[str, RopeConfig], ...]:
    """rope_parameters given by layer type (one object for each type `types` has; the first `partial_rotary_factor`
    features of each head rotated): ((type, its rope), ...), each refused by its field (Step-3.5's, Laguna's)."""
    kinds = sorted(set(types))
    if not isinstance(params, dict) or any(not isinstance(params.get(t), dict) for t in kinds):
        raise ConfigError(f"config.rope_parameters: expected one object per layer type ({', '.join(kinds)}), got "
                          f"{str(params)[:200]}")
    ropes = []
    for t in kinds:
        try:
            rope = rope_config_from_hf({"rope_parameters": params[t]})
        except (ValueError, TypeError) as e:
            raise ConfigError(f"config.rope_parameters.{t}: {e}") from None
        rotary = int(head_dim * rope.partial_rotary_factor)
        if rotary < 2 or rotary % 2:
            raise ConfigError(f"config.rope_parameters.{t}: partial_rotary_factor {rope.partial_rotary_factor} of "
                              f"head_dim={head_dim} rotates {rotary} features; needs an even number >= 2")
        ropes.append((t, rope))
    return tuple(ropes)


def _limits(d: dict, name: str, n: int) -> tuple[float | None, ...]:
    """A per-layer clamp list (absent: none; a 0 or null entry: none on that layer)."""
    value = d.get(name)
    if value is None:
        return (None,) * n
    if not isinstance(value, list) or len(value) != n or any(
            v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0) for v in value):
        raise ConfigError(f"config.{name}: expected {n} entries, each a bound >= 0 or null, got {value!r}"[:300])
    return tuple(float(v) if v else None for v in value)


class ClampedSiluMul:
    """The experts' activation on [N, 2I] rows (gate [0, I), up [I, 2I)) -> [N, I]: silu(gate) clamped above and up
    clamped both ways at `limit`, then their product (transformers' Step3p7Experts._apply_gate)."""

    def __init__(self, limit: float):
        self.limit = limit

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        I = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :I]).clamp(max=self.limit) * gate_up[:, I:].clamp(-self.limit, self.limit)

    def __repr__(self) -> str:
        return f"ClampedSiluMul(limit={self.limit})"


class ClampedMLP(GatedMLP):
    """down(silu(gate(x)).clamp(max=limit) * up(x).clamp(-limit, limit)); no clamp with `limit` None. Split over the
    TP ranks by features (`tp`), or replicated (the shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float | None, dtype: torch.dtype,
                 tp: TensorParallel | None = None):
        super().__init__(hidden_size, intermediate_size, "silu", dtype, tp=tp)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.act(self.gate_proj(x)), self.up_proj(x)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.tp.output_projection(self.down_proj, gate * up)


class SharedExpertMoE(nn.Module):
    """The biased sigmoid router (one group, its logits soft-capped at `logit_softcap` when > 0), the routed experts
    (their activation clamped at `limit`, where given), and one shared expert of its own width (clamped at
    `shared_limit`), replicated on every rank and added after the experts' reduction: Step-3.5's block and Laguna's
    (models/laguna.py), whose shared experts the registry never fuses."""

    def __init__(self, hidden_size: int, n_experts: int, top_k: int, width: int, shared_width: int,
                 routed_scaling_factor: float, plan, layer_id: int, dtype: torch.dtype, *, limit: float | None = None,
                 shared_limit: float | None = None, logit_softcap: float = 0.0):
        super().__init__()
        self.experts = RoutedExperts(n_experts, hidden_size, width, plan, layer_id=layer_id, dtype=dtype,
                                     activation=None if limit is None else ClampedSiluMul(limit))
        if self.experts.num_fused_shared_experts:
            raise ValueError(f"layer {layer_id}: plan fuses {self.experts.num_fused_shared_experts} shared expert "
                             f"slot(s); this shared expert is never fused")
        self.gate = DeepseekV3Router(RouterSpec(hidden_size, n_experts, top_k,
                                                routed_scaling_factor=routed_scaling_factor, logit_softcap=logit_softcap))
        self.shared_experts = ClampedMLP(hidden_size, shared_width, shared_limit, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        ids, weights = self.gate(x)                                  # [T, K] each, the scaling factor applied
        return self.experts(x, ids, weights.to(x.dtype)) + self.shared_experts(x)


class Step3p5DecoderLayer(DecoderLayer):
    """Turns q and k with its own kind's rotary tables (`rotary`: the model hands it those)."""

    NORM = OffsetRMSNorm

    def __init__(self, cfg: Step3p5Config, plan, layer_id: int, dtype: torch.dtype):
        tp = TensorParallel.of(plan)   # heads and dense features split over the TP ranks (the experts: RoutedExperts)
        kind = cfg.layer_types[layer_id]
        windowed = kind == "sliding_attention"
        rope = cfg.rope_of(kind)
        attn = GQAttention(AttentionSpec(cfg.hidden_size,
                                         cfg.num_sliding_attention_heads if windowed else cfg.num_attention_heads,
                                         cfg.num_key_value_heads, cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm="head",
                                         gate="per_head", norm=OffsetRMSNorm,
                                         rotary_dim=int(cfg.head_dim * rope.partial_rotary_factor),
                                         sliding_window=cfg.sliding_window if windowed else None,
                                         scale=cfg.attention_scale), tp=tp, dtype=dtype)
        if layer_id in cfg.moe_layers:
            mlp = SharedExpertMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                                  cfg.share_expert_dim, cfg.routed_scaling_factor, plan, layer_id, dtype,
                                  limit=cfg.swiglu_limits[layer_id], shared_limit=cfg.swiglu_limits_shared[layer_id])
        else:
            mlp = ClampedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limits_shared[layer_id], dtype, tp=tp)
        super().__init__(layer_id, attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, rope, cfg.max_position_embeddings)   # this kind's tables


class Step3p5ForCausalLM(DeclaredCausalLM):
    ARCHITECTURE = ARCHITECTURE
    TENSOR_PARALLEL = True
    CHECKPOINT_NAMES = STEP3P5_NAMES
    CONFIG = Step3p5Config
    DECODER_LAYER = Step3p5DecoderLayer

    def checkpoint_view(self, ckpt):
        return stacked_experts_shown_alone(ckpt, self.config.num_experts)


def stacked_experts_shown_alone(ckpt, n_experts: int) -> ShownTensors:
    """Each layer's stacked `moe.{gate,up,down}_proj.weight` ([E, I, D] / [E, D, I], as the model holds them) shown one
    expert at a time, `mlp.experts.{e}.{gate,up,down}_proj.weight`; a stack whose first dimension is not the
    config's expert count is shown whole, for the loader to refuse by name."""
    view = ShownTensors(ckpt)
    for name in ckpt.names():
        m = _STACKED.match(name)
        shape = tuple(ckpt.shape(name))
        if m is None or len(shape) != 3 or shape[0] != n_experts:
            view.show(name, name)
            continue
        for e in range(n_experts):
            view.show(f"{m['layer']}.mlp.experts.{e}.{m['proj']}.weight", name, shape[1:], lambda t, e=e: t[e])
    return view
