"""MiniMax-M2 (MiniMax-M2, M2.1, M2.5), numerically following transformers' modeling_minimax_m2.

Shapes: T tokens, D hidden, E experts, K top-k.

A Mixtral-shaped model (every layer sparse, SwiGLU experts of width intermediate_size,
no shared expert, so no fusion; the Hub's `block_sparse_moe.*` spelling) with two
differences that change the arithmetic:
- attention: q and k are each normalised by ONE RMSNorm over the whole projection, as
  OLMoE's (`qk_norm_span="projection"`), and only the first `rotary_dim` features of each
  head are rotated (rope theta 5e6);
- router: sigmoid scores; the top-k are chosen on the scores plus a per-expert
  correction bias (`e_score_correction_bias`, load balancing only) and weighted by the
  scores themselves, renormalised: DeepSeek-V3's router with one group and no scaling
  factor (layers/deepseek_router.py).
Its config.json carries fields transformers does not read; where one would change the
arithmetic (another scoring function, no routing bias, no qk norm, a shared expert, a
layer that is not full attention) it is refused by field rather than ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from loadplan.layouts import mixtral_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.deepseek_router import DeepseekV3Router, RouterSpec
from ..layers.mlp import activation
from ..moe import RoutedExperts
from ..parallel.tensor import TensorParallel
from ..weights import CheckpointNames
from .causal_lm import BlockLayer, DeclaredCausalLM
from .config import REQUIRED, ConfigError, DecoderConfig, get_field as _get, moe_layout, read_fields, read_rope
from .mixtral import MIXTRAL_NAMES
from .olmoe import OLMOE_NAMES

ARCHITECTURE = "MiniMaxM2ForCausalLM"

# The Hub's spelling -> the engine's: Mixtral's experts and router (`mlp.gate`, holding the correction bias too),
# and OLMoE's names for q/k norms that span the whole projection (weights.TP_SPLITS splits them).
MINIMAX_M2_NAMES = CheckpointNames(MIXTRAL_NAMES.pairs + OLMOE_NAMES.pairs + (
    ("block_sparse_moe.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
))

# Fields of the shipped config.json that transformers leaves unread, and the only values the model has.
FIXED_FIELDS = {"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
                "qk_norm_type": "per_layer", "shared_intermediate_size": 0}


@dataclass(frozen=True)
class MiniMaxM2Config(DecoderConfig):
    intermediate_size: int              # every expert's width
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    hidden_act: str
    num_experts: int
    num_experts_per_tok: int
    moe_layers: tuple[int, ...]
    # config.json's num_mtp_modules: MTP modules stored as model.layers.{L + i}. (published untrained), which
    # CausalLM.ignore_prefixes skips
    num_nextn_predict_layers: int = 0

    @classmethod
    def from_hf(cls, d: dict) -> "MiniMaxM2Config":
        """config.json with transformers' MiniMaxM2Config defaults where a checkpoint may leave a field out."""
        for name, value in FIXED_FIELDS.items():
            if name in d and d[name] != value:
                raise ConfigError(f"config.{name}: {d[name]!r} not supported; MiniMax-M2 runs {value!r}")
        kinds = d.get("attn_type_list")
        if kinds is not None and (not isinstance(kinds, list) or any(k != 1 for k in kinds)):
            raise ConfigError(f"config.attn_type_list: only full attention (1) is supported, got {kinds!r}"[:300])
        layout = moe_layout(mixtral_layout, d)          # the registry's reader of the layer and expert fields
        act = _get(d, "hidden_act", "silu", str)
        activation(act)   # refuses unknown activations by name
        head_dim = _get(d, "head_dim", 128, int)
        # The rotated share: transformers takes rope_parameters' (or rope_scaling's, or the top-level)
        # partial_rotary_factor when there is one, else rotary_dim / head_dim (the Hub's files give rotary_dim).
        rope = read_rope(d, partial_rotary_factor=0.0, default_theta=5e6)
        rotary_dim = d.get("rotary_dim")
        if rope.partial_rotary_factor:
            shared = round(head_dim * rope.partial_rotary_factor)
            if rotary_dim is not None and rotary_dim != shared:
                raise ConfigError(f"config.rotary_dim: {rotary_dim!r} disagrees with partial_rotary_factor "
                                  f"{rope.partial_rotary_factor} of head_dim {head_dim} ({shared} features)")
            rotary_dim = shared
        elif rotary_dim is None:
            rotary_dim = head_dim
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not (
                0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ConfigError(f"config.rotary_dim: {rotary_dim!r} must be even and in (0, head_dim={head_dim}]")
        # transformers' num_key_value_heads default, 8, fits no particular head count: a config must say it
        return cls(
            **read_fields(d, cls, dict(vocab_size=REQUIRED, hidden_size=REQUIRED, intermediate_size=REQUIRED,
                                       num_attention_heads=REQUIRED, num_key_value_heads=REQUIRED, rms_norm_eps=1e-6,
                                       max_position_embeddings=196608, tie_word_embeddings=False)),
            num_hidden_layers=len(layout.layer_ids), head_dim=head_dim, rotary_dim=rotary_dim, hidden_act=act,
            rope=dataclasses.replace(rope, partial_rotary_factor=rotary_dim / head_dim),
            num_experts=layout.n_routed, num_experts_per_tok=layout.top_k, moe_layers=layout.moe_layers,
            num_nextn_predict_layers=_get(d, "num_mtp_modules", 0, int) if d.get("use_mtp", True) else 0,
        )


class MiniMaxM2MoeBlock(nn.Module):
    """Sigmoid router with a correction bias for the choice (one group, no scaling factor), then the experts."""

    def __init__(self, cfg: MiniMaxM2Config, plan, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.gate = DeepseekV3Router(RouterSpec(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok))
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, plan,
                                     layer_id=layer_id, dtype=dtype)
        if self.experts.num_fused_shared_experts:
            raise ValueError(f"plan fuses {self.experts.num_fused_shared_experts} shared expert slot(s) but "
                             f"MiniMax-M2 has no shared expert")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        ids, weights = self.gate(x)                                        # [T, K] each, weights float32
        return self.experts(x, ids, weights.to(x.dtype))                   # reduced if the plan says


class MiniMaxM2DecoderLayer(BlockLayer):
    @classmethod
    def make_attention(cls, cfg: MiniMaxM2Config, layer_id: int, dtype: torch.dtype,
                       tp: TensorParallel) -> GQAttention:
        return GQAttention(AttentionSpec.of(cfg, qk_norm="projection", rotary_dim=cfg.rotary_dim), tp=tp, dtype=dtype)

    @classmethod
    def make_mlp(cls, cfg: MiniMaxM2Config, plan, layer_id: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        return MiniMaxM2MoeBlock(cfg, plan, layer_id, dtype)


class MiniMaxM2ForCausalLM(DeclaredCausalLM):
    ARCHITECTURE = ARCHITECTURE
    TENSOR_PARALLEL = True
    CHECKPOINT_NAMES = MINIMAX_M2_NAMES
    CONFIG = MiniMaxM2Config
    DECODER_LAYER = MiniMaxM2DecoderLayer
