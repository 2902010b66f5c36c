"""Qwen3-MoE and Qwen2-MoE (gpt-fast style), numerically following transformers' modeling files.

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
from ..layers.mlp import GatedMLP, activation
from ..layers.rope import RopeConfig
from ..moe import RoutedExperts
from ..parallel.tensor import TensorParallel
from .causal_lm import CausalLM, DecoderLayer
from .config import ConfigError, get_field as _get, moe_layout, read_rope


@dataclass(frozen=True)
class QwenMoeConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int              # dense MLP of mlp_only / non-sparse layers
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
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
        qwen2 = architecture == "Qwen2MoeForCausalLM"
        hidden = _get(d, "hidden_size", kind=int)
        heads = _get(d, "num_attention_heads", kind=int)
        if d.get("use_sliding_window"):
            raise ConfigError("config.use_sliding_window: sliding-window attention is not supported by the engine")
        layer_types = d.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ConfigError(f"config.layer_types: only full_attention is supported, got {sorted(set(layer_types))}")
        activation(_get(d, "hidden_act", "silu", str))   # refuses unknown activations by name
        # the registry's reader of the layer and expert fields (the Hub's num_experts, or transformers 5's
        # num_local_experts; Qwen2-MoE's shared expert where shared_expert_intermediate_size is set)
        layout = moe_layout(qwen2_moe_layout if qwen2 else qwen3_moe_layout, d)
        return cls(
            architecture=architecture,
            vocab_size=_get(d, "vocab_size", kind=int),
            hidden_size=hidden,
            intermediate_size=_get(d, "intermediate_size", kind=int),
            num_hidden_layers=len(layout.layer_ids),
            num_attention_heads=heads,
            num_key_value_heads=_get(d, "num_key_value_heads", heads, int),
            head_dim=_get(d, "head_dim", hidden // heads, int),
            rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6)),
            hidden_act=_get(d, "hidden_act", "silu", str),
            max_position_embeddings=_get(d, "max_position_embeddings", 32768, int),
            tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False, bool)),
            rope=read_rope(d),
            num_experts=layout.n_routed,
            num_experts_per_tok=layout.top_k,
            moe_intermediate_size=_get(d, "moe_intermediate_size", kind=int),
            norm_topk_prob=bool(_get(d, "norm_topk_prob", False, bool)),
            qkv_bias=bool(_get(d, "qkv_bias", True, bool)) if qwen2 else bool(_get(d, "attention_bias", False, bool)),
            o_bias=False if qwen2 else bool(_get(d, "attention_bias", False, bool)),
            qk_norm=not qwen2,
            # the shared expert's width: the layout says only whether there is one
            shared_expert_intermediate_size=(_get(d, "shared_expert_intermediate_size", kind=int)
                                             if layout.n_shared else 0),
            moe_layers=layout.moe_layers,
        )


def moe_fields(d: dict, layout: MoeLayout, *, rms_norm_eps: float, max_position_embeddings: int,
               rope: RopeConfig) -> dict:
    """The `QwenMoeConfig` fields Mixtral, OLMoE and their kin read alike: the layers, the MoE ones and the expert
    counts of `layout` (the registry's reading: `moe_layout`), experts of width intermediate_size; the keyword
    arguments are the family's transformers defaults for fields a checkpoint may leave out, and its rotary
    embedding as it reads it (`read_rope`)."""
    width = _get(d, "intermediate_size", kind=int)
    act = _get(d, "hidden_act", "silu", str)
    activation(act)   # refuses unknown activations by name
    return dict(
        vocab_size=_get(d, "vocab_size", kind=int),
        hidden_size=_get(d, "hidden_size", kind=int),
        intermediate_size=width,
        num_hidden_layers=len(layout.layer_ids),
        num_attention_heads=_get(d, "num_attention_heads", kind=int),
        rms_norm_eps=float(_get(d, "rms_norm_eps", rms_norm_eps)),
        hidden_act=act,
        max_position_embeddings=_get(d, "max_position_embeddings", max_position_embeddings, int),
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False, bool)),
        rope=rope,
        num_experts=layout.n_routed,
        num_experts_per_tok=layout.top_k,
        moe_intermediate_size=width,
        moe_layers=layout.moe_layers,
    )


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


class QwenDecoderLayer(DecoderLayer):
    MOE_BLOCK: type[nn.Module] = QwenSparseMoeBlock   # a family's own block of the same constructor (granitemoe.py)

    @classmethod
    def make_attention(cls, cfg: QwenMoeConfig, layer_id: int, dtype: torch.dtype, tp: TensorParallel) -> GQAttention:
        """The layer's attention (a family whose layers differ overrides it: Granite MoE SWA's, granitemoe.py)."""
        qk_norm = None if not cfg.qk_norm else "projection" if cfg.qk_norm_span == "projection" else \
            "head_after_rope" if cfg.qk_norm_after_rope else "head"
        return GQAttention(AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                         cfg.head_dim, cfg.rms_norm_eps, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
                                         qk_norm=qk_norm, clip_qkv=cfg.clip_qkv, sliding_window=cfg.sliding_window),
                           tp=tp, dtype=dtype)

    def __init__(self, cfg: QwenMoeConfig, plan, layer_id: int, dtype: torch.dtype):
        tp = TensorParallel.of(plan)   # heads and dense features split over the TP ranks (the experts: RoutedExperts)
        attn = self.make_attention(cfg, layer_id, dtype, tp)
        if layer_id in cfg.moe_layers:
            mlp = self.MOE_BLOCK(cfg, plan, layer_id, dtype)
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, tp=tp)
        super().__init__(layer_id, attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype)


class QwenLayerCausalLM(CausalLM):
    """An entry class built from `QwenDecoderLayer` (or a subclass: `DECODER_LAYER`): the Qwen families here,
    Mixtral, OLMoE, Granite MoE, Jamba, MiniMax (their own files), each giving `parse_config` (and `CHECKPOINT_NAMES`
    where its checkpoints spell tensors otherwise)."""

    ARCHITECTURE = ""
    TENSOR_PARALLEL = True
    DECODER_LAYER: type[QwenDecoderLayer] = QwenDecoderLayer

    @classmethod
    def parse_config(cls, hf_config: dict) -> QwenMoeConfig:
        return QwenMoeConfig.from_hf(hf_config, cls.ARCHITECTURE)

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        cfg = self.parse_config(hf_config)
        super().__init__(cfg, plan, self.DECODER_LAYER, n_routed=cfg.num_experts, rope_head_dim=cfg.head_dim,
                         dtype=dtype)


class Qwen3MoeForCausalLM(QwenLayerCausalLM):
    ARCHITECTURE = "Qwen3MoeForCausalLM"


class Qwen2MoeForCausalLM(QwenLayerCausalLM):
    ARCHITECTURE = "Qwen2MoeForCausalLM"
