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

from loadplan.layouts import solar_open_layout
from .config import ConfigError, Family
from .deepseek_v3 import expert_groups
from .glm4_moe import (GLM_FIELDS, Glm4MoeConfig, Glm4MoeForCausalLM, refuse_partial_rotary, rotary_dim,
                       theta_unless_given)

ARCHITECTURE = "SolarOpenForCausalLM"

# Fields of GLM-4-MoE's config that Solar Open's does not have, and the value that changes nothing.
NOT_RUN = (("use_qk_norm", False), ("num_nextn_predict_layers", 0), ("num_mtp_layers", 0))


def _not_run(d: dict, fields: dict) -> None:
    for field, harmless in NOT_RUN:
        if d.get(field) not in (None, harmless):
            raise ConfigError(f"config.{field}: {d[field]!r} not supported; Solar Open runs {harmless!r}"[:200])


# transformers' SolarOpenConfig defaults where GLM-4-MoE's differ (rope theta 1e6); no dense layer to size.
SOLAR_OPEN = Family(ARCHITECTURE, solar_open_layout, dict(
    GLM_FIELDS, vocab_size=196608, hidden_size=4096, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
    intermediate_size=0, moe_intermediate_size=1280, routed_scaling_factor=1.0, n_group=1, topk_group=1),
    rope=theta_unless_given(1_000_000.0,
                            lambda d: d.get("rope_parameters") is not None or d.get("rope_theta") is not None),
    fixed=dict(use_qk_norm=False, num_nextn_predict_layers=0),
    own=(_not_run, refuse_partial_rotary("Llama's attention rotates whole heads (1.0)"), expert_groups, rotary_dim))


class SolarOpenForCausalLM(Glm4MoeForCausalLM):
    ARCHITECTURE = ARCHITECTURE
    FAMILY = SOLAR_OPEN
    CONFIG = Glm4MoeConfig
