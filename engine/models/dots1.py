"""dots.llm1 (`Dots1ForCausalLM`, rednote-hilab), following transformers' modeling_dots1 numerically: Qwen3's
attention over DeepSeek-V3's MoE block, GLM-4-MoE's shape (models/glm4_moe.py) with Qwen3's attention.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads.

- Attention: grouped-query (layers/attention.py) with per-head RMSNorm on q and k, full rotary, a bias on
  q/k/v and o only with `attention_bias`; layer i slides over `sliding_window` positions iff
  i >= max_window_layers (transformers' layer_types, which ignore `use_sliding_window`: a config whose
  use_sliding_window false disagrees with the layers that rule makes sliding is refused, by field).
- Layer i is MoE iff i >= first_k_dense_replace, as the registry's DeepSeek layout reads it (its family's; it
  refuses a moe_layer_freq or mlp_layer_types that would say otherwise).
- MoE: DeepSeek-V3's block (deepseek_v3.DeepseekV3MoE): the sigmoid router with e_score_correction_bias and
  group-limited top-k, top-k weights renormalised only with `norm_topk_prob` (false by default here), and
  n_shared_experts shared experts, one MLP of n_shared x the width (dots.llm1 ships 2: so the registry's
  DeepSeek gate never fuses them, and it is not the fused architecture anyway: DESIGN 5.2).
"""

from __future__ import annotations

from dataclasses import dataclass


from loadplan.layouts import deepseek_layout
from ..layers.attention import AttentionSpec
from .config import ConfigError, Family, get_field as _get, window_of
from .deepseek_v3 import expert_groups
from .glm4_moe import (GLM_FIELDS, Glm4MoeConfig, Glm4MoeDecoderLayer, Glm4MoeForCausalLM, refuse_partial_rotary,
                       rotary_dim)

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Dots1Config(Glm4MoeConfig):
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()


def _attention_kinds(d: dict, fields: dict) -> dict:
    """The window (transformers' default 4096; null: no layer slides) and layer_types (by default the layers from
    max_window_layers slide)."""
    n = fields.num_hidden_layers
    window = None if d.get("sliding_window", 4096) is None else _get(d, "sliding_window", 4096, int)
    if window is not None and window < 1:
        raise ConfigError(f"config.sliding_window: must be >= 1, got {window}")
    if d.get("layer_types") is not None:
        types = d["layer_types"]
        if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(f"config.layer_types: expected {n} entries of {', '.join(LAYER_TYPES)}, got "
                              f"{types!r}"[:300])
    else:
        first_sliding = _get(d, "max_window_layers", n, int)
        types = ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                 for i in range(n)]
        if "sliding_attention" in types and d.get("use_sliding_window") is False:
            raise ConfigError(f"config.use_sliding_window: false, but sliding_window={window} and "
                              f"max_window_layers={first_sliding} make layers {first_sliding}..{n - 1} slide "
                              f"(transformers' rule, which ignores use_sliding_window): say which by setting "
                              f"sliding_window null or max_window_layers {n}")
    if "sliding_attention" in types and window is None:
        raise ConfigError("config.sliding_window: null, but layer_types has sliding_attention layers")
    return dict(sliding_window=window, layer_types=tuple(types))


# GLM-4-MoE's fields with dots.llm1's defaults where they differ; the layers and experts as the registry's DeepSeek
# reader reads them.
DOTS1 = Family("Dots1ForCausalLM", deepseek_layout, dict(
    GLM_FIELDS, norm_topk_prob=False, max_position_embeddings=2048, rms_norm_eps=1e-6),
    rope={"partial_rotary_factor": 1.0}, fixed=dict(use_qk_norm=True),
    own=(refuse_partial_rotary("Qwen3's attention rotates whole heads (1.0)"), expert_groups, rotary_dim,
         _attention_kinds))


class Dots1DecoderLayer(Glm4MoeDecoderLayer):
    @classmethod
    def attention_spec(cls, cfg: Dots1Config, layer_id: int) -> AttentionSpec:
        return AttentionSpec.of(cfg, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm="head",
                                rotary_dim=cfg.rotary_dim, sliding_window=window_of(cfg, layer_id))


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    ARCHITECTURE = "Dots1ForCausalLM"
    FAMILY = DOTS1
    CONFIG = Dots1Config
    DECODER_LAYER = Dots1DecoderLayer
