"""MiMo-V2-Flash (`MiMoV2FlashForCausalLM`: Xiaomi's), following transformers' modeling_mimo_v2_flash
numerically.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads, hd / dv query-key / value
head dims.

- Attention: grouped-query, values narrower than queries and keys (`v_head_dim`) and scaled by
  `attention_value_scale` as they are projected; q/k/v biases with `attention_bias`, none on o_proj. Layer i is
  windowed ("sliding_attention": `sliding_window` positions, twice num_key_value_heads, a learned sink logit per
  head, as gpt-oss's; the checkpoint's `attention_sink_bias`) or global ("full_attention"), by `layer_types` (by
  default the first layer and every 6th global). Each kind has its own rotary embedding (`rope_parameters` by layer
  type: theta and the rotated fraction of each head, 0.334 unless said; by default the released model's 5e6 global
  and 1e4 windowed), so each layer turns q and k with its own kind's tables.
- Layer i is MoE iff mlp_layer_types[i] is "sparse" (by default all but the first). MoE: DeepSeek-V3's block
  (deepseek_v3.DeepseekV3MoE) with no shared expert: the sigmoid router with e_score_correction_bias and
  group-limited top-k, renormalised, scaled by routed_scaling_factor (the Hub's null: 1).
- Its released checkpoints store Multi-Token-Prediction layers under `model.mtp.`: skipped by name, as transformers
  skips them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from loadplan.layouts import mimo_v2_flash_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.rope import RopeConfig, RotaryEmbedding, rope_config_from_hf
from ..parallel.tensor import TensorParallel
from ..weights import CheckpointNames
from .causal_lm import DecoderLayer
from .config import ConfigError, get_field as _get, moe_layout, per_layer
from .deepseek_v3 import moe_or_dense_mlp
from .glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM

ARCHITECTURE = "MiMoV2FlashForCausalLM"
LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.334
# (checkpoint, engine) suffixes under model.layers.{i}: the windowed layers' sink logits.
MIMO_V2_FLASH_NAMES = CheckpointNames((("self_attn.attention_sink_bias", "self_attn.sinks"),))
# transformers' defaults: the released model's thetas, by layer type
DEFAULT_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}


@dataclass(frozen=True)
class MiMoV2FlashConfig(Glm4MoeConfig):
    v_head_dim: int = 128
    attention_value_scale: float = 1.0
    sliding_window: int = 129
    layer_types: tuple[str, ...] = ()
    ropes: tuple[tuple[str, RopeConfig], ...] = ()     # (layer type, its rope)

    def rope_of(self, layer_type: str) -> RopeConfig:
        return dict(self.ropes)[layer_type]

    @classmethod
    def from_hf(cls, d: dict) -> "MiMoV2FlashConfig":
        """transformers' MiMoV2FlashConfig defaults where a checkpoint may leave a field out."""
        layout = moe_layout(mimo_v2_flash_layout, d)     # the registry's reader of the layer and expert fields
        scale = d.get("routed_scaling_factor")
        no_rope = {name: v for name, v in d.items() if name not in ("rope_scaling", "rope_parameters")}
        # Glm4MoeConfig reads the other fields both share, with MiMo-V2-Flash's defaults, its layers and experts the
        # layout's; its rope is read below, by kind.
        glm = Glm4MoeConfig.from_layout(dict(
            no_rope, partial_rotary_factor=1.0,
            routed_scaling_factor=1.0 if scale is None else scale, norm_topk_prob=d.get("norm_topk_prob", True),
            head_dim=_get(d, "head_dim", 192, int), intermediate_size=d.get("intermediate_size", 16384),
            moe_intermediate_size=d.get("moe_intermediate_size", 2048),
            max_position_embeddings=d.get("max_position_embeddings", 131072)), layout)
        n = glm.num_hidden_layers
        # the attention kind of each layer (the layout gives the MLP's)
        types = per_layer(d, "layer_types", n, LAYER_TYPES,
                          ["full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention" for i in range(n)])
        window = _get(d, "sliding_window", 129, int)
        if d.get("sliding_window_size") is not None:        # the Hub's spelling: the tokens before the query
            window = _get(d, "sliding_window_size", kind=int) + 1
        if window < 1:
            raise ConfigError(f"config.sliding_window: must be >= 1, got {window}")
        value_scale = d.get("attention_value_scale", 0.707)
        if value_scale is not None and (isinstance(value_scale, bool) or not isinstance(value_scale, (int, float))):
            raise ConfigError(f"config.attention_value_scale: expected a number or null, got {value_scale!r}")
        params = d.get("rope_parameters") or DEFAULT_ROPE
        if not isinstance(params, dict) or any(not isinstance(params.get(t), dict) for t in set(types)):
            raise ConfigError(f"config.rope_parameters: expected one object per layer type "
                              f"({', '.join(LAYER_TYPES)}), got {str(params)[:200]}")
        ropes = []
        for t in sorted(set(types)):
            try:
                rope = rope_config_from_hf({"rope_parameters": params[t]},
                                           partial_rotary_factor=DEFAULT_PARTIAL_ROTARY_FACTOR)
            except ValueError as e:
                raise ConfigError(f"config.rope_parameters.{t}: {e}") from None
            rotary = int(glm.head_dim * rope.partial_rotary_factor)
            if rotary < 2 or rotary % 2:
                raise ConfigError(f"config.rope_parameters.{t}: partial_rotary_factor {rope.partial_rotary_factor} of "
                                  f"head_dim={glm.head_dim} rotates {rotary} features; needs an even number >= 2")
            ropes.append((t, rope))
        return cls(**dict({f.name: getattr(glm, f.name) for f in dataclasses.fields(Glm4MoeConfig)},
                          rope=dict(ropes).get("full_attention", ropes[0][1])),
                   v_head_dim=_get(d, "v_head_dim", 128, int),
                   attention_value_scale=1.0 if value_scale is None else float(value_scale),
                   sliding_window=window, layer_types=tuple(types), ropes=tuple(ropes))


class MiMoV2FlashDecoderLayer(DecoderLayer):
    """Turns q and k with its own kind's rotary tables (`rotary`: the model hands it those)."""

    def __init__(self, cfg: MiMoV2FlashConfig, plan, layer_id: int, dtype: torch.dtype):
        tp = TensorParallel.of(plan)   # heads and dense features split over the TP ranks (the experts: RoutedExperts)
        kind = cfg.layer_types[layer_id]
        windowed = kind == "sliding_attention"
        self_rope = cfg.rope_of(kind)
        attn = GQAttention(AttentionSpec(cfg.hidden_size, cfg.num_attention_heads,
                                         cfg.num_key_value_heads * (2 if windowed else 1), cfg.head_dim,
                                         rms_norm_eps=cfg.rms_norm_eps, qkv_bias=cfg.attention_bias,
                                         rotary_dim=int(cfg.head_dim * self_rope.partial_rotary_factor),
                                         sliding_window=cfg.sliding_window if windowed else None, sinks=windowed,
                                         v_head_dim=cfg.v_head_dim,
                                         v_scale=cfg.attention_value_scale), tp=tp, dtype=dtype)
        super().__init__(layer_id, attn, moe_or_dense_mlp(cfg, plan, layer_id, dtype, tp), cfg.hidden_size,
                         cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, self_rope, cfg.max_position_embeddings)   # this kind's tables


class MiMoV2FlashForCausalLM(Glm4MoeForCausalLM):
    ARCHITECTURE = ARCHITECTURE
    MTP_PREFIXES = ("model.mtp.",)
    FAMILY = None                       # MiMoV2FlashConfig.from_hf reads its ropes by layer kind
    CONFIG = MiMoV2FlashConfig
    DECODER_LAYER = MiMoV2FlashDecoderLayer
    CHECKPOINT_NAMES = MIMO_V2_FLASH_NAMES
