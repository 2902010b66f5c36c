"""EXAONE-MoE (`ExaoneMoeForCausalLM`: LG AI Research's K-EXAONE), following transformers' modeling_exaone_moe
numerically: Qwen3's attention over DeepSeek-V3's MoE block, in a hybrid of windowed and global layers.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads.

- Attention: grouped-query (layers/attention.py) with per-head RMSNorm on q and k (before the rotation), no
  biases. Layer i is windowed (`sliding_window`) unless (i + 1) % sliding_window_pattern == 0 (transformers'
  layer_types, or the config's own); windowed layers rotate q and k, the global ones do not (NoPE).
- Layer i is MoE iff mlp_layer_types[i] is "sparse" (by default every layer from first_k_dense_replace).
- MoE: DeepSeek-V3's block (deepseek_v3.DeepseekV3MoE): the sigmoid router with e_score_correction_bias (the
  checkpoint keeps it as `mlp.e_score_correction_bias`) and group-limited top-k, weights renormalised and scaled
  by routed_scaling_factor, num_experts routed experts and num_shared_experts shared ones (one MLP of that many
  times the width, added ungated), which the registry never fuses (our choice: no fused layout exists).
"""

from __future__ import annotations

from dataclasses import dataclass


from loadplan.layouts import exaone_moe_layout
from ..layers.attention import AttentionSpec
from ..weights import CheckpointNames
from .config import ConfigError, Family, sliding_window, windowed_layer_types, window_of
from .deepseek_v3 import expert_groups
from .glm4_moe import (GLM_FIELDS, Glm4MoeConfig, Glm4MoeDecoderLayer, Glm4MoeForCausalLM, refuse_partial_rotary,
                       rotary_dim)

ARCHITECTURE = "ExaoneMoeForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}.
EXAONE_MOE_NAMES = CheckpointNames((("mlp.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),))


@dataclass(frozen=True)
class ExaoneMoeConfig(Glm4MoeConfig):
    sliding_window: int = 4096
    layer_types: tuple[str, ...] = ()        # per layer; "sliding_attention" ones are windowed and rotated


def _attention_kinds(d: dict, fields: dict) -> dict:
    """No biases; layer_types (every sliding_window_pattern-th layer global) and the window, which may not be null."""
    if fields.attention_bias:
        raise ConfigError("config.attention_bias: true is not supported; EXAONE-MoE's projections have none")
    if "sliding_window" in d and d["sliding_window"] is None:
        raise ConfigError("config.sliding_window: null is not supported; EXAONE-MoE's windowed layers need one "
                          "(transformers requires an integer)")
    return dict(sliding_window=sliding_window(d, 4096),
                layer_types=tuple(windowed_layer_types(d, fields.num_hidden_layers, "sliding_window_pattern", 4)))


# transformers' ExaoneMoeConfig defaults where a checkpoint may leave a field out; the MoE layers by mlp_layer_types.
EXAONE_MOE = Family(ARCHITECTURE, exaone_moe_layout, dict(
    GLM_FIELDS, routed_scaling_factor=2.5, max_position_embeddings=2048, moe_intermediate_size=1024),
    rope={"partial_rotary_factor": 1.0}, fixed=dict(use_qk_norm=True),
    own=(refuse_partial_rotary("EXAONE-MoE rotates whole heads (1.0)"), expert_groups, rotary_dim, _attention_kinds))


class ExaoneMoeDecoderLayer(Glm4MoeDecoderLayer):
    @classmethod
    def attention_spec(cls, cfg: ExaoneMoeConfig, layer_id: int) -> AttentionSpec:
        window = window_of(cfg, layer_id)
        return AttentionSpec.of(cfg, qk_norm="head", sliding_window=window, use_rope=window is not None)


class ExaoneMoeForCausalLM(Glm4MoeForCausalLM):
    ARCHITECTURE = ARCHITECTURE
    FAMILY = EXAONE_MOE
    CONFIG = ExaoneMoeConfig
    DECODER_LAYER = ExaoneMoeDecoderLayer
    CHECKPOINT_NAMES = EXAONE_MOE_NAMES
