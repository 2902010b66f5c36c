"""Jamba (`JambaForCausalLM`: AI21's Jamba 1.5 / 1.7 Mini and Large), following transformers' modeling_jamba
numerically.

Shapes: B batch, T tokens, D hidden, E experts, K top-k, V vocab.

A hybrid of Mamba layers (layers/mamba1.py, with dt, B and C RMS-normalised) and attention layers without rotary
embedding or biases: layer i is attention iff i % attn_layer_period == attn_layer_offset. Each layer's feed-forward
is, iff i % expert_layer_period == expert_layer_offset (and num_experts > 1), Mixtral's routed experts with the top-k of
the softmax over every expert, NOT renormalised; else a dense SwiGLU MLP. No shared expert, so no fusion.
The checkpoints spell the parts otherwise than the engine (`JAMBA_NAMES`): `feed_forward` for the MLP (its `router`
for the router), `pre_ff_layernorm` for the second norm, `model.final_layernorm` for the final one. Under tensor
parallelism the attention heads, the dense MLP's and every expert's features split as Mixtral's, and each Mamba layer
holds its rank's channels (layers/mamba1.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loadplan.layouts import jamba_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.mamba1 import Mamba1Mixer, in_proj_by_rank
from ..parallel.tensor import TensorParallel
from ..weights import CheckpointNames
from .config import ConfigError, Family, get_field as _get, heads_wide
from .qwen_moe import EXPERTS_AS_WIDE, MOE_FIELDS, QwenDecoderLayer, QwenLayerCausalLM, QwenMoeConfig

ARCHITECTURE = "JambaForCausalLM"

# (checkpoint, engine) suffixes (under model.layers.{i}, and the final norm's).
JAMBA_NAMES = CheckpointNames((
    ("feed_forward.router.weight", "mlp.gate.weight"),
    *((f"feed_forward.{mlp}{proj}_proj.weight", f"mlp.{mlp}{proj}_proj.weight")
      for mlp in ("experts.{e}.", "") for proj in ("gate", "up", "down")),
    ("pre_ff_layernorm.weight", "post_attention_layernorm.weight"),
    ("model.final_layernorm.weight", "model.norm.weight"),
))


def _period_offset(d: dict, period_field: str, offset_field: str, period: int, offset: int) -> tuple[int, int]:
    p, o = _get(d, period_field, period, int), _get(d, offset_field, offset, int)
    if p < 1:
        raise ConfigError(f"config.{period_field}: must be >= 1, got {p}")
    if not 0 <= o < p:
        raise ConfigError(f"config.{offset_field}: must be in [0, {period_field}={p}), got {o}")
    return p, o


@dataclass(frozen=True)
class JambaConfig(QwenMoeConfig):
    layer_kinds: tuple[str, ...] = ()     # "mamba" / "attention" per layer
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_inner: int = 0                  # mamba_expand * hidden_size
    mamba_dt_rank: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False


def _layer_kinds(d: dict, fields: dict) -> dict:
    """Each layer's token mixer (attention iff i % attn_layer_period == attn_layer_offset, else Mamba) and the Mamba
    layers' sizes. The registry's reader says which layers are MoE (i % expert_layer_period == expert_layer_offset)
    and refuses fewer than 2 experts (a Jamba without routed experts is dense)."""
    if fields.hidden_act != "silu":   # the Mamba conv runs the config's activation; only SiLU is tested
        raise ConfigError(f"config.hidden_act: {fields.hidden_act!r} not supported; Jamba runs 'silu'")
    n, hidden = fields.num_hidden_layers, fields.hidden_size
    attn_period, attn_offset = _period_offset(d, "attn_layer_period", "attn_layer_offset", 8, 4)
    expand = _get(d, "mamba_expand", 2, int)
    for name, value in (("mamba_expand", expand), ("mamba_d_state", fields.mamba_d_state),
                        ("mamba_d_conv", fields.mamba_d_conv)):
        if value < 1:
            raise ConfigError(f"config.{name}: must be >= 1, got {value}")
    rank = d.get("mamba_dt_rank", "auto")
    rank = math.ceil(hidden / 16) if rank in ("auto", None) else _get(d, "mamba_dt_rank", kind=int)
    if rank < 1:
        raise ConfigError(f"config.mamba_dt_rank: must be >= 1 or \"auto\", got {rank}")
    return dict(layer_kinds=tuple("attention" if i % attn_period == attn_offset else "mamba" for i in range(n)),
                mamba_inner=expand * hidden, mamba_dt_rank=rank)


# transformers' JambaConfig defaults where a checkpoint may leave a field out; the heads hidden_size // heads wide.
JAMBA = Family(ARCHITECTURE, jamba_layout, dict(
    MOE_FIELDS, vocab_size=65536, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
    rms_norm_eps=1e-6, max_position_embeddings=262144, num_key_value_heads=8, mamba_d_state=16, mamba_d_conv=4,
    mamba_conv_bias=True, mamba_proj_bias=False), rope={"default_theta": 10000.0},
    fixed=dict(EXPERTS_AS_WIDE, head_dim=heads_wide, norm_topk_prob=False, qkv_bias=False, o_bias=False,
               qk_norm=False), own=(_layer_kinds,))


class JambaDecoderLayer(QwenDecoderLayer):
    """Mixtral's layer (routed experts not renormalised, or a dense MLP); its token mixer Mamba or NoPE attention."""

    @classmethod
    def make_attention(cls, cfg: JambaConfig, layer_id: int, dtype: torch.dtype, tp) -> GQAttention | None:
        if cfg.layer_kinds[layer_id] == "mamba":
            return None
        return GQAttention(AttentionSpec.of(cfg, use_rope=False), tp=tp, dtype=dtype)

    def __init__(self, cfg: JambaConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        self.mamba = Mamba1Mixer(cfg.hidden_size, cfg.mamba_inner, cfg.mamba_d_state, cfg.mamba_dt_rank,
                                 cfg.mamba_d_conv, cfg.mamba_conv_bias, cfg.mamba_proj_bias, cfg.rms_norm_eps,
                                 dtype, tp=TensorParallel.of(plan)) if cfg.layer_kinds[layer_id] == "mamba" else None

    @property
    def mixer(self):
        return self.mamba if self.mamba is not None else self.self_attn


class JambaForCausalLM(QwenLayerCausalLM):
    ARCHITECTURE = ARCHITECTURE
    DECODER_LAYER = JambaDecoderLayer
    CHECKPOINT_NAMES = JAMBA_NAMES

    FAMILY = JAMBA
    CONFIG = JambaConfig

    def checkpoint_view(self, ckpt):
        """With tp_size > 1, the Mamba layers' in_proj rows regrouped by rank (layers/mamba1.py)."""
        tp, cfg = self.plan.request.parallel.tp_size, self.config
        if tp == 1:
            return ckpt
        return in_proj_by_rank(ckpt, [f"model.layers.{i}.mamba." for i, k in enumerate(cfg.layer_kinds)
                                      if k == "mamba"], tp, cfg.mamba_inner)
