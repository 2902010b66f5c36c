"""GLM-4-MoE (GLM-4.5, GLM-4.5-Air), following transformers' modeling_glm4_moe numerically.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads.

- Attention: grouped-query (layers/attention.py) with q/k/v bias (`attention_bias`; o_proj has
  none), optional per-head RMSNorm on q and k (`use_qk_norm`), and partial rotary: the first
  `partial_rotary_factor` of each head is rotated (rotate-half layout), the rest passes through.
  transformers assumes 0.5 when a config does not say (GLM's released configs do).
- Layer i is MoE iff i >= first_k_dense_replace (transformers has no moe_layer_freq here; the
  registry's layout counts one, so a config that sets it to anything but 1 is refused).
- MoE: DeepSeek-V3's block as it is (deepseek_v3.DeepseekV3MoE): the sigmoid router with
  e_score_correction_bias and group-limited top-k, routed experts whose weights carry
  routed_scaling_factor, and n_shared_experts shared experts, one MLP of n_shared x the width:
    unfused: out = routed(x) + shared_experts(x)   (replicated, after any reduction)
    fused (plan): the shared expert is slot n_routed_experts, counted x1 (DESIGN 5.3).
- The Multi-Token-Prediction layers stored after the last decoder layer
  (model.layers.{num_hidden_layers}...) are not part of the causal LM: skipped at load.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from loadplan.layouts import glm4_moe_layout, glm4_moe_nextn_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..parallel.tensor import TensorParallel
from .causal_lm import DeclaredCausalLM, DecoderLayer
from .config import ConfigError, Family, as_heads, heads_wide, read_rope
from .deepseek_v3 import DEEPSEEK_MOE_FIELDS, DeepseekMoeConfig, DeepseekMoeLayer, expert_groups

# transformers' Glm4MoeConfig: "partial_rotary_factor" defaults to 0.5 (kept for older configs).
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


@dataclass(frozen=True, kw_only=True)
class Glm4MoeConfig(DeepseekMoeConfig):
    """DeepSeek's MoE layers (`attention_bias`: q/k/v projections carry a bias) under grouped-query attention."""

    num_key_value_heads: int
    head_dim: int
    rotary_dim: int                   # the rotated part of each head: head_dim * partial_rotary_factor
    use_qk_norm: bool

    @classmethod
    def from_hf(cls, d: dict, *, nextn: bool = False) -> "Glm4MoeConfig":
        """A NextN draft (`nextn`) reads its layers with the registry's reader of the MTP layers after the target's."""
        return (GLM4_MOE_NEXTN if nextn else GLM4_MOE).read(d, cls)

    @classmethod
    def from_layout(cls, d: dict, layout, *, nextn: bool = False) -> "Glm4MoeConfig":
        """config.json `d` read as GLM-4-MoE's fields, its layers and experts as `layout` says (`moe_layout` of the
        family's reader: a family of GLM's shape under other names reads them with its own)."""
        return (GLM4_MOE_NEXTN if nextn else GLM4_MOE).read(d, cls, layout=layout)


def rotary_dim(d: dict, fields: dict) -> dict:
    """The rotated part of each head: head_dim * partial_rotary_factor, an even number in (0, head_dim]."""
    head_dim, factor = fields.head_dim, fields.rope.partial_rotary_factor
    rotated = int(head_dim * factor)
    if not (0 < rotated <= head_dim and rotated % 2 == 0):
        raise ConfigError(f"config.partial_rotary_factor: {factor} of head_dim={head_dim} "
                          f"gives {rotated} rotated features; needs an even number in (0, head_dim]")
    return {"rotary_dim": rotated}


def refuse_partial_rotary(why: str):
    """A step of `Family.own` that refuses a config's partial_rotary_factor other than 1, saying `why` (the family
    reads its rope with 1.0: it rotates whole heads)."""
    def check(d: dict, fields: dict) -> None:
        partial = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise ConfigError(f"config.partial_rotary_factor: {partial!r} not supported; {why}")
    return check


def theta_unless_given(theta: float, given=lambda d: d.get("rope_parameters") or d.get("rope_theta") is not None):
    """A `Family.rope` that reads the rope of whole heads with `theta` where config.json does not `given` one."""
    return lambda d: read_rope(d if given(d) else dict(d, rope_theta=theta), partial_rotary_factor=1.0)


# transformers' Glm4MoeConfig defaults where a checkpoint may leave a field out (partial_rotary_factor: 0.5, kept for
# older configs; GLM's released configs say it); DeepseekV3MoE's groups scored by their two best experts.
GLM_FIELDS = dict(DEEPSEEK_MOE_FIELDS, num_key_value_heads=as_heads, head_dim=heads_wide, use_qk_norm=False,
                  max_position_embeddings=131072, rms_norm_eps=1e-5)
GLM4_MOE = Family("Glm4MoeForCausalLM", glm4_moe_layout, GLM_FIELDS,
                  rope={"partial_rotary_factor": DEFAULT_PARTIAL_ROTARY_FACTOR}, own=(expert_groups, rotary_dim))
GLM4_MOE_NEXTN = replace(GLM4_MOE, architecture="Glm4MoeForCausalLMNextN", layout=glm4_moe_nextn_layout, draft=True)


class Glm4MoeDecoderLayer(DeepseekMoeLayer):
    """Grouped-query attention (`attention_spec`: a family of GLM's shape overrides it) over DeepSeek-V3's MoE block
    or the dense MLP."""

    @classmethod
    def attention_spec(cls, cfg: Glm4MoeConfig, layer_id: int) -> AttentionSpec:
        return AttentionSpec.of(cfg, qkv_bias=cfg.attention_bias, qk_norm="head" if cfg.use_qk_norm else None,
                                rotary_dim=cfg.rotary_dim)

    @classmethod
    def make_attention(cls, cfg: Glm4MoeConfig, layer_id: int, dtype: torch.dtype, tp: TensorParallel) -> GQAttention:
        return GQAttention(cls.attention_spec(cfg, layer_id), tp=tp, dtype=dtype)


class Glm4MoeForCausalLM(DeclaredCausalLM):
    """Its row, config and layer classes are attributes, so that a family of the same shape declares its own
    (models/dots1.py)."""

    TENSOR_PARALLEL = True
    FAMILY = GLM4_MOE
    CONFIG: type[Glm4MoeConfig] = Glm4MoeConfig
    DECODER_LAYER: type[DecoderLayer] = Glm4MoeDecoderLayer
