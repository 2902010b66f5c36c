"""Solar Open (`SolarOpenForCausalLM`: Upstage's Solar-Open-100B), following transformers' modeling_solar_open
numerically: Llama's attention over GLM-4-MoE's MoE block on every layer, GLM-4-MoE's shape (models/glm4_moe.py).

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads.

- Attention: grouped-query (layers/attention.py), whole heads rotated (rotate-half layout), a bias on q/k/v with
  `attention_bias` and none on o_proj, no q/k norms.
- Every layer is MoE: DeepSeek-V3's block (deepseek_v3.DeepseekV3MoE) as GLM-4-MoE runs it, the sigmoid router
  with e_score_correction_bias and group-limited top-k, and n_shared_experts shared experts beside the routed ones,
  never fused (our choice: the registry's solar_open gate).
- transformers' SolarOpenConfig has no q/k norm or MTP layers: a config that asks for them is refused by field, as is
  a partial rotary factor (Llama's attention rotates whole heads). It has no first_k_dense_replace or moe_layer_freq
  either: not read (every layer is MoE, as the registry's solar_open_layout reads it).
"""

from __future__ import annotations

import dataclasses

from loadplan.layouts import solar_open_layout
from .config import ConfigError, moe_layout
from .glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM

ARCHITECTURE = "SolarOpenForCausalLM"

# transformers' SolarOpenConfig defaults where GLM-4-MoE's differ (its layer and expert fields: solar_open_layout's).
DEFAULTS = dict(vocab_size=196608, hidden_size=4096, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                moe_intermediate_size=1280, routed_scaling_factor=1.0, n_group=1, topk_group=1, rope_theta=1_000_000.0)
# Fields of GLM-4-MoE's config that Solar Open's does not have, and the value that changes nothing.
NOT_RUN = (("use_qk_norm", False), ("num_nextn_predict_layers", 0), ("num_mtp_layers", 0))


@dataclasses.dataclass(frozen=True)
class SolarOpenConfig(Glm4MoeConfig):
    @classmethod
    def from_hf(cls, d: dict) -> "SolarOpenConfig":
        for field, harmless in NOT_RUN:
            if d.get(field) not in (None, harmless):
                raise ConfigError(f"config.{field}: {d[field]!r} not supported; Solar Open runs {harmless!r}"[:200])
        partial = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise ConfigError(f"config.partial_rotary_factor: {partial!r} not supported; Llama's attention rotates "
                              f"whole heads (1.0)")
        named = {**{k: v for k, v in DEFAULTS.items() if k != "rope_theta"}, **d}
        if d.get("rope_parameters") is None and d.get("rope_theta") is None:
            named["rope_theta"] = DEFAULTS["rope_theta"]
        named.setdefault("intermediate_size", 0)        # no dense layer to size
        layout = moe_layout(solar_open_layout, d)        # the registry's reader of the layer and expert fields
        # Glm4MoeConfig reads the rest, its layers and experts the layout's
        glm = Glm4MoeConfig.from_layout(dict(named, partial_rotary_factor=1.0, use_qk_norm=False,
                                             num_nextn_predict_layers=0), layout)
        return cls(**{f.name: getattr(glm, f.name) for f in dataclasses.fields(Glm4MoeConfig)})


class SolarOpenForCausalLM(Glm4MoeForCausalLM):
    ARCHITECTURE = ARCHITECTURE
    CONFIG = SolarOpenConfig
