"""Laguna (`LagunaForCausalLM`), following transformers' modeling_laguna numerically.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads, hd head_dim.

- Attention: grouped-query with per-head RMSNorm on q and k (before the rotation), a head count per layer
  (num_attention_heads_per_layer); layer i is windowed ("sliding_attention": `sliding_window` positions) or global
  ("full_attention"), by `layer_types`, each kind with its own rotary embedding (rope_parameters by layer type:
  transformers' defaults rotate half of each global head at theta 5e5 and whole windowed heads at 1e4). The output
  is gated by softplus(g_proj(x)): one gate a head (`gating` true or "per-head") or one a feature.
- Layer i is MoE iff mlp_layer_types[i] is "sparse" (by default all but the first). MoE: a sigmoid router whose top-k
  is chosen with a routing bias (the checkpoint's `mlp.experts.e_score_correction_bias`), its logits soft-capped at
  moe_router_logit_softcapping (0: not), weighted by the scores renormalised, scaled by moe_routed_scaling_factor
  (layers/deepseek_router.py, one group); num_experts experts and a shared expert of shared_expert_intermediate_size
  (the checkpoint's `mlp.shared_expert`), which the registry never fuses (our choice: its width is its own).
- moe_apply_router_weight_on_input, which transformers does not read, is refused when true.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loadplan.layouts import laguna_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.mlp import GatedMLP, activation
from ..layers.rope import RopeConfig, RotaryEmbedding
from ..parallel.tensor import TensorParallel
from ..weights import CheckpointNames
from .causal_lm import DeclaredCausalLM, DecoderLayer
from .config import ConfigError, DecoderConfig, get_field as _get, moe_layout, per_layer, read_fields, sliding_window
from .step3p5 import LAYER_TYPES, RopesByKind, SharedExpertMoE, rope_of_each_type

ARCHITECTURE = "LagunaForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}.
LAGUNA_NAMES = CheckpointNames((
    ("mlp.experts.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
    ("self_attn.g_proj.weight", "self_attn.gate_proj.weight"),
    *((f"mlp.shared_expert.{p}.weight", f"mlp.shared_experts.{p}.weight")
      for p in ("gate_proj", "up_proj", "down_proj")),
))
# transformers' default ropes, by layer type
DEFAULT_ROPES = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}


@dataclass(frozen=True)
class LagunaConfig(DecoderConfig, RopesByKind):
    intermediate_size: int               # the dense layers' MLP
    heads_per_layer: tuple[int, ...]
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    # rope: the global layers' (each layer turns q and k with its kind's: `ropes`)
    ropes: tuple[tuple[str, RopeConfig], ...]
    layer_types: tuple[str, ...]
    sliding_window: int
    attention_bias: bool
    gate_per_head: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    routed_scaling_factor: float
    router_logit_softcap: float
    moe_layers: tuple[int, ...]

    @classmethod
    def from_hf(cls, d: dict) -> "LagunaConfig":
        """transformers' LagunaConfig defaults where a checkpoint may leave a field out."""
        if d.get("moe_apply_router_weight_on_input"):
            raise ConfigError("config.moe_apply_router_weight_on_input: true is not supported; transformers' Laguna "
                              "weights the experts' outputs (it does not read the field)")
        layout = moe_layout(laguna_layout, d)          # the registry's reader of the layer and expert fields
        n = len(layout.layer_ids)
        heads = _get(d, "num_attention_heads", 48, int)
        per_layer_heads = _get(d, "num_attention_heads_per_layer", [heads] * n, list)
        if len(per_layer_heads) != n or any(isinstance(h, bool) or not isinstance(h, int) or h < 1
                                            for h in per_layer_heads):
            raise ConfigError(f"config.num_attention_heads_per_layer: expected {n} positive integers, got "
                              f"{per_layer_heads!r}"[:300])
        types = per_layer(d, "layer_types", n, LAYER_TYPES, ["full_attention"] * n)
        window = sliding_window(d, 512)
        gating = d.get("gating", True)
        if gating not in (True, False, "per-head", "per-element"):
            raise ConfigError(f"config.gating: {gating!r} is not supported; true / \"per-head\" (a gate a head) or "
                              f"false / \"per-element\" (a gate a feature)")
        act = _get(d, "hidden_act", "silu", str)
        activation(act)   # refuses unknown activations by name
        head_dim = _get(d, "head_dim", 128, int)
        params = d.get("rope_parameters") or DEFAULT_ROPES
        ropes = rope_of_each_type(params, types, head_dim)
        softcap = float(_get(d, "moe_router_logit_softcapping", 0.0, (int, float)))
        if softcap < 0:
            raise ConfigError(f"config.moe_router_logit_softcapping: must be >= 0, got {softcap}")
        return cls(
            **read_fields(d, cls, dict(vocab_size=100352, hidden_size=2048, intermediate_size=8192,
                                       num_key_value_heads=8, rms_norm_eps=1e-6, max_position_embeddings=131072,
                                       tie_word_embeddings=False, attention_bias=False, moe_intermediate_size=512,
                                       routed_scaling_factor=1.0),
                          names=dict(routed_scaling_factor="moe_routed_scaling_factor")),
            num_hidden_layers=n, heads_per_layer=tuple(per_layer_heads), head_dim=head_dim, hidden_act=act,
            rope=dict(ropes).get("full_attention", ropes[0][1]), ropes=ropes, layer_types=tuple(types),
            sliding_window=window, gate_per_head=gating in (True, "per-head"), num_experts=layout.n_routed,
            num_experts_per_tok=layout.top_k,
            shared_expert_intermediate_size=_get(d, "shared_expert_intermediate_size", 512, int),
            router_logit_softcap=softcap, moe_layers=layout.moe_layers)


class LagunaDecoderLayer(DecoderLayer):
    """Turns q and k with its own kind's rotary tables (`rotary`: the model hands it those)."""

    def __init__(self, cfg: LagunaConfig, plan, layer_id: int, dtype: torch.dtype):
        tp = TensorParallel.of(plan)   # heads and dense features split over the TP ranks (the experts: RoutedExperts)
        kind = cfg.layer_types[layer_id]
        rope = cfg.rope_of(kind)
        attn = GQAttention(AttentionSpec(cfg.hidden_size, cfg.heads_per_layer[layer_id], cfg.num_key_value_heads,
                                         cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, qkv_bias=cfg.attention_bias,
                                         o_bias=cfg.attention_bias, qk_norm="head",
                                         gate="per_head" if cfg.gate_per_head else "projection",
                                         rotary_dim=int(cfg.head_dim * rope.partial_rotary_factor),
                                         sliding_window=cfg.sliding_window if kind == "sliding_attention" else None,
                                         gate_activation="softplus"), tp=tp, dtype=dtype)
        if layer_id in cfg.moe_layers:
            mlp = SharedExpertMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                                  cfg.shared_expert_intermediate_size, cfg.routed_scaling_factor, plan, layer_id,
                                  dtype, logit_softcap=cfg.router_logit_softcap)
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, tp=tp)
        super().__init__(layer_id, attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, rope, cfg.max_position_embeddings)   # this kind's tables


class LagunaForCausalLM(DeclaredCausalLM):
    ARCHITECTURE = ARCHITECTURE
    TENSOR_PARALLEL = True
    CHECKPOINT_NAMES = LAGUNA_NAMES
    CONFIG = LagunaConfig
    DECODER_LAYER = LagunaDecoderLayer
