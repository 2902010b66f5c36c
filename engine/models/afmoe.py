"""AFMoE (`AfmoeForCausalLM`: Arcee's Trinity models), following transformers' modeling_afmoe numerically.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads.

- Attention: grouped-query (layers/attention.py) with per-head RMSNorm on q and k, an output gate (its own
  `gate_proj`, H x head_dim features: the attention output times sigmoid(gate) before o_proj) and q/k/v/o biases
  with `attention_bias`. Layer i is windowed (`sliding_window`) unless (i + 1) % global_attn_every_n_layers == 0
  (transformers' layer_types, or the config's own); windowed layers rotate q and k, the global ones do not (NoPE).
- Sandwich norms: the attention's output and the MLP's output are each normalised before their residual sum, as
  their inputs are (input_layernorm / post_attention_layernorm, pre_mlp_layernorm / post_mlp_layernorm).
- Layer i is MoE iff i >= num_dense_layers. MoE: DeepSeek-V3's block (deepseek_v3.DeepseekV3MoE) as a sigmoid router
  with a routing bias (the checkpoint's `mlp.expert_bias`) and one group: top-k of sigmoid + bias, the sigmoid
  scores renormalised and scaled by `route_scale`; num_shared_experts shared experts (one MLP of that many times
  the width) added ungated, which the registry never fuses (our choice: no fused layout exists). The router's
  weight is kept float32 (transformers computes the logits in the model's dtype, then casts: alike in float32).
- muP (`mup_enabled`): the token embeddings are scaled by sqrt(hidden_size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loadplan.layouts import afmoe_layout
from ..layers.attention import AttentionSpec
from ..weights import CheckpointNames
from .config import ConfigError, Family, get_field as _get, windowed_layer_types, window_of
from .glm4_moe import (GLM_FIELDS, Glm4MoeConfig, Glm4MoeDecoderLayer, Glm4MoeForCausalLM, refuse_partial_rotary,
                       rotary_dim)

ARCHITECTURE = "AfmoeForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}.
AFMOE_NAMES = CheckpointNames((
    ("mlp.router.gate.weight", "mlp.gate.weight"),
    ("mlp.expert_bias", "mlp.gate.e_score_correction_bias"),
))


@dataclass(frozen=True)
class AfmoeConfig(Glm4MoeConfig):
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()        # per layer; "sliding_attention" ones are windowed and rotated
    mup_enabled: bool = False


def _attention_kinds(d: dict, fields: dict) -> dict:
    """No expert groups; layer_types (every global_attn_every_n_layers-th layer global) and the window."""
    for name in ("n_group", "topk_group"):
        if d.get(name) not in (None, 1):
            raise ConfigError(f"config.{name}: {d[name]!r} not supported; AFMoE's router has no expert groups")
    types = windowed_layer_types(d, fields.num_hidden_layers, "global_attn_every_n_layers", 4)
    window = _get(d, "sliding_window", 1024, int) if "sliding_window" not in d or d["sliding_window"] is not None \
        else None
    if window is None and "sliding_attention" in types:
        raise ConfigError("config.sliding_window: null, but layer_types has sliding_attention layers")
    if window is not None and window < 1:
        raise ConfigError(f"config.sliding_window: must be >= 1, got {window}")
    return dict(sliding_window=window, layer_types=tuple(types))


# transformers' AfmoeConfig defaults where a checkpoint may leave a field out; the router scaled by route_scale.
AFMOE = Family(ARCHITECTURE, afmoe_layout, dict(
    GLM_FIELDS, head_dim=128, max_position_embeddings=16384, moe_intermediate_size=1408, mup_enabled=False),
    names=dict(routed_scaling_factor="route_scale"), rope={"partial_rotary_factor": 1.0},
    fixed=dict(n_group=1, topk_group=1, norm_topk_prob=True, use_qk_norm=True),
    own=(refuse_partial_rotary("AFMoE rotates whole heads"), _attention_kinds, rotary_dim))


class AfmoeDecoderLayer(Glm4MoeDecoderLayer):
    """x + post_attention_layernorm(attn(input_layernorm(x))), then
    x + post_mlp_layernorm(mlp(pre_mlp_layernorm(x)))."""

    @classmethod
    def attention_spec(cls, cfg: AfmoeConfig, layer_id: int) -> AttentionSpec:
        window = window_of(cfg, layer_id)
        return AttentionSpec.of(cfg, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm="head",
                                gate="projection", sliding_window=window, use_rope=window is not None)

    def __init__(self, cfg: AfmoeConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        self.pre_mlp_layernorm = self.NORM(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_mlp_layernorm = self.NORM(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x, cos, sin, input_pos=None):
        """x [B, T, D] -> [B, T, D]"""
        x = x + self.post_attention_layernorm(self.mixer(self.input_layernorm(x), cos, sin, input_pos))
        B, T, D = x.shape
        h = self.pre_mlp_layernorm(x).reshape(B * T, D)
        return x + self.post_mlp_layernorm(self.mlp(h)).view(B, T, D)


class AfmoeForCausalLM(Glm4MoeForCausalLM):
    ARCHITECTURE = ARCHITECTURE
    FAMILY = AFMOE
    CONFIG = AfmoeConfig
    DECODER_LAYER = AfmoeDecoderLayer
    CHECKPOINT_NAMES = AFMOE_NAMES

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        return h * self.config.hidden_size ** 0.5 if self.config.mup_enabled else h
