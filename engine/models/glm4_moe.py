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

from dataclasses import dataclass

import torch

from loadplan.layouts import glm4_moe_layout, glm4_moe_nextn_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.mlp import activation
from ..parallel.tensor import TensorParallel
from .causal_lm import CausalLM, DecoderLayer
from .config import ConfigError, DecoderConfig, get_field as _get, moe_layout, read_rope
from .deepseek_v3 import first_moe_layer, moe_or_dense_mlp, routing_fields

# transformers' Glm4MoeConfig: "partial_rotary_factor" defaults to 0.5 (kept for older configs).
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


@dataclass(frozen=True)
class Glm4MoeConfig(DecoderConfig):
    intermediate_size: int            # dense layers
    moe_intermediate_size: int        # each routed expert; the shared MLP is n_shared_experts times wider
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int                   # the rotated part of each head: head_dim * partial_rotary_factor
    attention_bias: bool              # q/k/v projections carry a bias
    use_qk_norm: bool
    hidden_act: str
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    num_nextn_predict_layers: int
    moe_layers: tuple[int, ...]
    scoring_func: str = "sigmoid"     # DeepSeek-V3's router (what DeepseekV3MoE asks); ERNIE-4.5: softmax
    topk_method: str = "noaux_tc"     # the bias-corrected top-k of that router
    renorm_min: float | None = None   # its renormalisation's clamp (ERNIE-4.5); None: + 1e-20

    @classmethod
    def from_hf(cls, d: dict, *, nextn: bool = False) -> "Glm4MoeConfig":
        # The registry's reader of the layer and expert fields: a NextN draft's (its MTP layers after the target's)
        # or the model's.
        layout = moe_layout(glm4_moe_nextn_layout if nextn else glm4_moe_layout, d)
        return cls.from_layout(d, layout, nextn=nextn)

    @classmethod
    def from_layout(cls, d: dict, layout, *, nextn: bool = False) -> "Glm4MoeConfig":
        """config.json `d` read as GLM-4-MoE's fields, its layers and experts as `layout` says (`moe_layout` of the
        family's reader: a family of GLM's shape under other names reads them with its own)."""
        hidden_act = _get(d, "hidden_act", "silu", str)
        activation(hidden_act)  # refuses unknown activations by name
        hidden = _get(d, "hidden_size", kind=int)
        heads = _get(d, "num_attention_heads", kind=int)
        # A draft's layers are numbered after the target's num_hidden_layers (what its config dataclass counts).
        n_layers = layout.layer_ids[0] if nextn else len(layout.layer_ids)
        routing = routing_fields(d, layout, norm_topk_prob_default=True, group_scores_of_two=True)
        head_dim = _get(d, "head_dim", None, int) or hidden // heads
        rope = read_rope(d, partial_rotary_factor=DEFAULT_PARTIAL_ROTARY_FACTOR)
        rotary_dim = int(head_dim * rope.partial_rotary_factor)
        if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ConfigError(f"config.partial_rotary_factor: {rope.partial_rotary_factor} of head_dim={head_dim} "
                              f"gives {rotary_dim} rotated features; needs an even number in (0, head_dim]")
        return cls(
            vocab_size=_get(d, "vocab_size", kind=int),
            hidden_size=hidden,
            intermediate_size=_get(d, "intermediate_size", kind=int),
            moe_intermediate_size=_get(d, "moe_intermediate_size", kind=int),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=_get(d, "num_key_value_heads", heads, int),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope=rope,
            attention_bias=bool(_get(d, "attention_bias", False, bool)),
            use_qk_norm=bool(_get(d, "use_qk_norm", False, bool)),
            max_position_embeddings=_get(d, "max_position_embeddings", 131072, int),
            rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-5)),
            hidden_act=hidden_act,
            tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False, bool)),
            **routing,
            first_k_dense_replace=first_moe_layer(layout),
            num_nextn_predict_layers=_get(d, "num_nextn_predict_layers", 0, int),
            moe_layers=layout.moe_layers,
        )


class Glm4MoeDecoderLayer(DecoderLayer):
    def __init__(self, cfg: Glm4MoeConfig, plan, layer_id: int, dtype: torch.dtype):
        tp = TensorParallel.of(plan)   # heads and dense features split over the TP ranks (the experts: RoutedExperts)
        attn = GQAttention(AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                         cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, qkv_bias=cfg.attention_bias,
                                         qk_norm="head" if cfg.use_qk_norm else None,
                                         rotary_dim=cfg.rotary_dim), tp=tp, dtype=dtype)
        super().__init__(layer_id, attn, moe_or_dense_mlp(cfg, plan, layer_id, dtype, tp), cfg.hidden_size,
                         cfg.rms_norm_eps, dtype)


class Glm4MoeForCausalLM(CausalLM):
    """Its config and layer classes are attributes, so that a family of the same shape declares its own
    (models/dots1.py)."""

    TENSOR_PARALLEL = True
    CONFIG: type[Glm4MoeConfig] = Glm4MoeConfig
    DECODER_LAYER: type[DecoderLayer] = Glm4MoeDecoderLayer

    @classmethod
    def parse_config(cls, hf_config: dict) -> Glm4MoeConfig:
        return cls.CONFIG.from_hf(hf_config)

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        cfg = self.parse_config(hf_config)
        super().__init__(cfg, plan, self.DECODER_LAYER, n_routed=cfg.n_routed_experts, rope_head_dim=cfg.head_dim,
                         dtype=dtype)
