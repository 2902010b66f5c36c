"""Qwen3-MoE and Qwen2-MoE, numerically following transformers' modeling files.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads.

Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): q/k/v bias, one shared expert whose output
is scaled per token by sigmoid(shared_expert_gate(x)). Fused (plan), the shared
expert is routed slot E and that sigmoid is its routing weight (times the plan's
scale). Qwen3-MoE: no shared expert, per-head RMSNorm on q and k, head_dim from config.
Layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (loadplan/layouts.py
reads it: `moe_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from loadplan.layouts import MoeLayout, qwen2_moe_layout, qwen3_moe_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.mlp import GatedMLP
from ..moe import RoutedExperts
from ..parallel.tensor import TensorParallel
from .causal_lm import BlockLayer, DeclaredCausalLM
from .config import REQUIRED, ConfigError, DecoderConfig, Family, as_heads, heads_wide


@dataclass(frozen=True)
class QwenMoeConfig(DecoderConfig):
    architecture: str
    intermediate_size: int              # dense MLP of mlp_only / non-sparse layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    qkv_bias: bool                      # q/k/v projections carry a bias
    o_bias: bool                        # o_proj carries a bias (Qwen3 attention_bias)
    qk_norm: bool                       # Qwen3: RMSNorm per head on q and k
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE; 0 = no shared expert
    shared_intermediate_size: int = 0          # an ungated shared MLP (SharedMlpMoeBlock); 0 = none
    moe_layers: tuple[int, ...] = field(default=())
    sliding_window: int | None = None          # Mixtral's (models/mixtral.py); the Qwen families refuse theirs
    qk_norm_span: str = "head"                 # OLMoE (models/olmoe.py): "projection", one norm over all heads
    clip_qkv: float | None = None              # OLMoE: q, k, v clamped to +-clip_qkv
    qk_norm_after_rope: bool = False           # Hunyuan (models/hunyuan_v1_moe.py): q/k norms after the rotation

    @classmethod
    def from_hf(cls, d: dict, architecture: str) -> "QwenMoeConfig":
        return QWEN_FAMILIES[architecture].read(d, cls)

    @classmethod
    def layout_fields(cls, layout: MoeLayout, d: dict, draft: bool = False) -> dict:
        """The fields the registry's layout gives (`moe_layout`): the layers, the MoE ones, the expert counts (no
        family of Qwen's layer has a draft row)."""
        return dict(num_hidden_layers=len(layout.layer_ids), num_experts=layout.n_routed,
                    num_experts_per_tok=layout.top_k, moe_layers=layout.moe_layers)


def _full_attention_only(d: dict, fields: dict) -> None:
    """Qwen's refusal of the sliding windows its configs may switch on."""
    if d.get("use_sliding_window"):
        raise ConfigError("config.use_sliding_window: sliding-window attention is not supported by the engine")
    layer_types = d.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"config.layer_types: only full_attention is supported, got {sorted(set(layer_types))}")


# The fields Mixtral, OLMoE and their kin read alike (transformers has no default for them); their experts are
# intermediate_size wide (`EXPERTS_AS_WIDE`).
MOE_FIELDS = dict(vocab_size=REQUIRED, hidden_size=REQUIRED, intermediate_size=REQUIRED,
                  num_attention_heads=REQUIRED, hidden_act="silu", tie_word_embeddings=False)
EXPERTS_AS_WIDE = {"moe_intermediate_size": lambda f: f.intermediate_size}
_QWEN = dict(MOE_FIELDS, num_key_value_heads=as_heads, head_dim=heads_wide, rms_norm_eps=1e-6,
             max_position_embeddings=32768, moe_intermediate_size=REQUIRED, norm_topk_prob=False)
# Qwen2-MoE: its shared expert's width where the registry's layout has one (shared_expert_intermediate_size).
QWEN_FAMILIES = {
    "Qwen3MoeForCausalLM": Family("Qwen3MoeForCausalLM", qwen3_moe_layout, dict(_QWEN, qkv_bias=False),
                                  names={"qkv_bias": "attention_bias"}, own=(_full_attention_only,),
                                  fixed={"o_bias": lambda f: f.qkv_bias, "qk_norm": True}),
    "Qwen2MoeForCausalLM": Family("Qwen2MoeForCausalLM", qwen2_moe_layout, dict(_QWEN, qkv_bias=True),
                                  own=(_full_attention_only,), fixed={"o_bias": False, "qk_norm": False},
                                  shared="shared_expert_intermediate_size"),
}


class QwenSparseMoeBlock(nn.Module):
    """Router (softmax top-k), routed experts, and Qwen2-MoE's gated shared expert (fused or not)."""

    def __init__(self, cfg: QwenMoeConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__()
        D = cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(D, cfg.num_experts, bias=False, dtype=dtype)          # router
        self.experts = RoutedExperts(cfg.num_experts, D, cfg.moe_intermediate_size, plan,
                                     layer_id=layer_id, dtype=dtype)
        shared = cfg.shared_expert_intermediate_size
        fused = self.experts.num_fused_shared_experts
        if fused and (shared == 0 or fused != 1):
            raise ValueError(f"plan fuses {fused} shared expert slot(s) but the config has "
                             f"{'no' if shared == 0 else 'one'} shared expert")
        if fused and shared != cfg.moe_intermediate_size:
            raise ValueError(f"plan fuses the shared expert but shared_expert_intermediate_size={shared} != "
                             f"moe_intermediate_size={cfg.moe_intermediate_size}")
        # Unfused: the shared expert runs on its own, replicated, added after the experts' reduction.
        self.shared_expert = GatedMLP(D, shared, cfg.hidden_act, dtype) if shared and not fused else None
        self.shared_expert_gate = nn.Linear(D, 1, bias=False, dtype=dtype) if shared else None

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, E] (a family whose router computes otherwise overrides it: models/hunyuan_v1_moe.py)"""
        return self.gate(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        logits = self.router_logits(x)                                     # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)           # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)               # [T, K]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        if self.experts.num_fused_shared_experts:
            gate = torch.sigmoid(self.shared_expert_gate(x))               # [T, 1] the fused slot's weight
            ids, weights = self.experts.append_shared_slots(ids, weights, gate)
        y = self.experts(x, ids, weights)                                  # [T, D], reduced if the plan says
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class SharedMlpMoeBlock(QwenSparseMoeBlock):
    """The routed experts and, when the config sizes one (`cfg.shared_intermediate_size` > 0), an ungated shared MLP
    `shared_mlp` added to their output after the experts' reduction, replicated on every rank: GraniteMoeShared's
    (models/granitemoe.py) and Hunyuan's (models/hunyuan_v1_moe.py), which their registry gates never fuse."""

    def __init__(self, cfg: QwenMoeConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        shared = cfg.shared_intermediate_size
        self.shared_mlp = GatedMLP(cfg.hidden_size, shared, cfg.hidden_act, dtype) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        y = super().forward(x)
        return y if self.shared_mlp is None else y + self.shared_mlp(x)


class Float32RouterMoeBlock(SharedMlpMoeBlock):
    """`SharedMlpMoeBlock` whose router weight stays float32 whatever the model's dtype and scores float32 inputs, as
    transformers keeps Hunyuan's, Flint's and Kolibri-1's (models/hunyuan_v1_moe.py, flint.py, kolibri1.py)."""

    def __init__(self, cfg: QwenMoeConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False, dtype=torch.float32)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, E] float32"""
        return F.linear(x.float(), self.gate.weight)


class QwenDecoderLayer(BlockLayer):
    MOE_BLOCK: type[nn.Module] = QwenSparseMoeBlock   # a family's own block of the same constructor (granitemoe.py)

    @classmethod
    def make_attention(cls, cfg: QwenMoeConfig, layer_id: int, dtype: torch.dtype, tp: TensorParallel) -> GQAttention:
        """The layer's attention (a family whose layers differ overrides it: Granite MoE SWA's, granitemoe.py)."""
        qk_norm = None if not cfg.qk_norm else "projection" if cfg.qk_norm_span == "projection" else \
            "head_after_rope" if cfg.qk_norm_after_rope else "head"
        return GQAttention(AttentionSpec.of(cfg, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=qk_norm,
                                            clip_qkv=cfg.clip_qkv, sliding_window=cfg.sliding_window),
                           tp=tp, dtype=dtype)

    @classmethod
    def make_mlp(cls, cfg: QwenMoeConfig, plan, layer_id: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        if layer_id in cfg.moe_layers:
            return cls.MOE_BLOCK(cfg, plan, layer_id, dtype)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, tp=tp)


class QwenLayerCausalLM(DeclaredCausalLM):
    """An entry class built from `QwenDecoderLayer` (or a subclass: `DECODER_LAYER`) and its family's row (`FAMILY`):
    the Qwen families here, Mixtral, OLMoE, Granite MoE, Jamba, MiniMax and their kin (their own files)."""

    TENSOR_PARALLEL = True
    CONFIG: type[QwenMoeConfig] = QwenMoeConfig
    DECODER_LAYER: type[QwenDecoderLayer] = QwenDecoderLayer


class Qwen3MoeForCausalLM(QwenLayerCausalLM):
    ARCHITECTURE = "Qwen3MoeForCausalLM"
    FAMILY = QWEN_FAMILIES[ARCHITECTURE]


class Qwen2MoeForCausalLM(QwenLayerCausalLM):
    ARCHITECTURE = "Qwen2MoeForCausalLM"
    FAMILY = QWEN_FAMILIES[ARCHITECTURE]
