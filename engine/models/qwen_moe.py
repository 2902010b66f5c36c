"""Qwen3-MoE and Qwen2-MoE (gpt-fast style), numerically following transformers' modeling files.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads.

Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): q/k/v bias, one shared expert whose output
is scaled per token by sigmoid(shared_expert_gate(x)). Fused (plan), the shared
expert is routed slot E and that sigmoid is its routing weight (times the plan's
scale). Qwen3-MoE: no shared expert, per-head RMSNorm on q and k, head_dim from config.
Layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ...plan import Keys
from ..layers.attention import GQAttention
from ..layers.kv_cache import KVCache
from ..layers.mlp import GatedMLP, activation
from ..layers.norm import RMSNorm
from ..layers.rope import RopeConfig, RotaryEmbedding, rope_config_from_hf
from ..moe import RoutedExperts
from ..weights import WeightLayout
from . import ExpertWeightsView, PPMissingLayer


class ConfigError(ValueError):
    pass


_MISSING = object()


def _get(d: dict, name: str, default=_MISSING, kind=None):
    v = d.get(name)
    if v is None:
        if default is _MISSING:
            raise ConfigError(f"config.{name}: missing")
        return default
    if kind is not None and (not isinstance(v, kind) or (kind is not bool and isinstance(v, bool))):
        raise ConfigError(f"config.{name}: expected {getattr(kind, '__name__', kind)}, got {v!r}")
    return v


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
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    qkv_bias: bool                      # q/k/v projections carry a bias
    o_bias: bool                        # o_proj carries a bias (Qwen3 attention_bias)
    qk_norm: bool                       # Qwen3: RMSNorm per head on q and k
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE; 0 = no shared expert
    moe_layers: tuple[int, ...] = field(default=())

    @classmethod
    def from_hf(cls, d: dict, architecture: str) -> "QwenMoeConfig":
        qwen2 = architecture == "Qwen2MoeForCausalLM"
        hidden = _get(d, "hidden_size", kind=int)
        heads = _get(d, "num_attention_heads", kind=int)
        n_layers = _get(d, "num_hidden_layers", kind=int)
        if d.get("use_sliding_window"):
            raise ConfigError("config.use_sliding_window: sliding-window attention is not supported by the engine")
        layer_types = d.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ConfigError(f"config.layer_types: only full_attention is supported, got {sorted(set(layer_types))}")
        activation(_get(d, "hidden_act", "silu", str))   # refuses unknown activations by name
        step = _get(d, "decoder_sparse_step", 1, int)
        if step < 1:
            raise ConfigError(f"config.decoder_sparse_step: must be >= 1, got {step}")
        mlp_only = tuple(_get(d, "mlp_only_layers", [], list))
        # The Hub spells it num_experts; transformers 5 saves Qwen3-MoE's as num_local_experts.
        n_experts = _get(d, "num_experts", None, int)
        if n_experts is None:
            n_experts = _get(d, "num_local_experts", kind=int)
        top_k = _get(d, "num_experts_per_tok", kind=int)
        if not 0 < top_k <= n_experts:
            raise ConfigError(f"config.num_experts_per_tok: {top_k} must be in [1, num_experts={n_experts}]")
        moe_layers = tuple(i for i in range(n_layers)
                           if n_experts > 0 and i not in mlp_only and (i + 1) % step == 0)
        return cls(
            architecture=architecture,
            vocab_size=_get(d, "vocab_size", kind=int),
            hidden_size=hidden,
            intermediate_size=_get(d, "intermediate_size", kind=int),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=_get(d, "num_key_value_heads", heads, int),
            head_dim=_get(d, "head_dim", hidden // heads, int),
            rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6)),
            hidden_act=_get(d, "hidden_act", "silu", str),
            max_position_embeddings=_get(d, "max_position_embeddings", 32768, int),
            tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False, bool)),
            rope=rope_config_from_hf(d),
            num_experts=n_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=_get(d, "moe_intermediate_size", kind=int),
            norm_topk_prob=bool(_get(d, "norm_topk_prob", False, bool)),
            decoder_sparse_step=step,
            mlp_only_layers=mlp_only,
            qkv_bias=bool(_get(d, "qkv_bias", True, bool)) if qwen2 else bool(_get(d, "attention_bias", False, bool)),
            o_bias=False if qwen2 else bool(_get(d, "attention_bias", False, bool)),
            qk_norm=not qwen2,
            shared_expert_intermediate_size=_get(d, "shared_expert_intermediate_size", 0, int) if qwen2 else 0,
            moe_layers=moe_layers,
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        logits = self.gate(x)                                              # [T, E]
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


class QwenDecoderLayer(nn.Module):
    def __init__(self, cfg: QwenMoeConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = GQAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                     qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=cfg.qk_norm,
                                     rms_norm_eps=cfg.rms_norm_eps, dtype=dtype)
        if layer_id in cfg.moe_layers:
            self.mlp = QwenSparseMoeBlock(cfg, plan, layer_id, dtype)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x, cos, sin, input_pos=None):
        """x [B, T, D] -> [B, T, D]"""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, input_pos)
        B, T, D = x.shape
        h = self.post_attention_layernorm(x).reshape(B * T, D)
        return x + self.mlp(h).view(B, T, D)


class QwenMoeModel(nn.Module):
    def __init__(self, cfg: QwenMoeConfig, plan, layer_range: tuple[int, int], first: bool, last: bool,
                 dtype: torch.dtype):
        super().__init__()
        lo, hi = layer_range
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype) if first else None
        self.layers = nn.ModuleList(QwenDecoderLayer(cfg, plan, i, dtype) if lo <= i < hi else PPMissingLayer(i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if last else None


class _QwenMoeForCausalLM(nn.Module):
    ARCHITECTURE = ""

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        cfg = QwenMoeConfig.from_hf(hf_config, self.ARCHITECTURE)
        self.config = cfg
        self.plan = plan
        self.dtype = dtype
        lo, hi = (int(v) for v in plan.decisions[Keys.PP_LAYER_RANGE].value)
        if not 0 <= lo < hi <= cfg.num_hidden_layers:
            raise ValueError(f"plan's pp.layer_range [{lo}, {hi}) is outside the config's "
                             f"{cfg.num_hidden_layers} layers")
        self.layer_range = (lo, hi)
        self.is_first_stage, self.is_last_stage = lo == 0, hi == cfg.num_hidden_layers
        self.model = QwenMoeModel(cfg, plan, self.layer_range, self.is_first_stage, self.is_last_stage, dtype)
        # Tied embeddings on a single stage: the head reads the embedding's weight (no lm_head parameter).
        separate_head = self.is_last_stage and not (cfg.tie_word_embeddings and self.is_first_stage)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype) if separate_head else None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        self.moe_layer_ids = tuple(i for i in cfg.moe_layers if lo <= i < hi)
        self.routed_experts_weights_of_layer = ExpertWeightsView(
            {i: self.model.layers[i].mlp.experts for i in self.moe_layer_ids})
        if plan.decisions[Keys.EPLB_ENABLED].value:
            eplb_layers = [int(i) for i in plan.decisions[Keys.EPLB_LAYERS].value]
            if eplb_layers != list(self.moe_layer_ids):
                raise ValueError(f"plan's eplb.layers {eplb_layers} differ from this stage's MoE layers "
                                 f"{list(self.moe_layer_ids)}")

    # -- loading ---------------------------------------------------------------
    def weight_layout(self) -> WeightLayout:
        n_fused, local, physical = 0, None, None
        if self.moe_layer_ids:
            ex = self.model.layers[self.moe_layer_ids[0]].mlp.experts
            n_fused, local = ex.num_fused_shared_experts, (ex.local_start, ex.local_start + ex.num_local_experts)
            physical = ex.num_physical
        return WeightLayout(
            n_routed=self.config.num_experts, num_fused_shared=n_fused, local_experts=local,
            num_physical=physical,
            layer_range=self.layer_range, has_embed=self.is_first_stage, has_head=self.is_last_stage,
            lm_head_from_embed=self.config.tie_word_embeddings and self.is_last_stage and not self.is_first_stage)

    def tie_weights(self) -> None:
        pass  # a tied head reads model.embed_tokens.weight directly (see _head)

    # -- running ---------------------------------------------------------------
    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        cfg = self.config
        device = next(self.parameters()).device
        for layer in self.model.layers:
            if isinstance(layer, QwenDecoderLayer):
                layer.self_attn.kv_cache = KVCache(max_batch_size, cfg.num_key_value_heads, max_seq_len,
                                                   cfg.head_dim, self.dtype, device)

    def clear_caches(self) -> None:
        for layer in self.model.layers:
            if isinstance(layer, QwenDecoderLayer):
                layer.self_attn.kv_cache = None

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        w = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return F.linear(h, w)

    def forward(self, input_ids: torch.Tensor | None = None, input_pos: torch.Tensor | None = None, *,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] (first stage) or hidden_states [B, T, D] -> logits [B, T, V] (last stage)."""
        with self.plan.forward_running():
            if self.is_first_stage:
                if input_ids is None:
                    raise ValueError("the first pipeline stage takes input_ids")
                x = self.model.embed_tokens(input_ids)                     # [B, T, D]
            else:
                if hidden_states is None:
                    raise ValueError(f"pipeline stage {self.layer_range} takes hidden_states")
                x = hidden_states
            T = x.shape[1]
            if input_pos is None:
                input_pos = torch.arange(T, device=x.device)
            cos, sin = self.rotary(input_pos)                              # [T, hd] each
            lo, hi = self.layer_range
            for layer in self.model.layers[lo:hi]:
                x = layer(x, cos, sin, input_pos)
            if not self.is_last_stage:
                return x
            return self._head(self.model.norm(x))                          # [B, T, V]


class Qwen3MoeForCausalLM(_QwenMoeForCausalLM):
    ARCHITECTURE = "Qwen3MoeForCausalLM"


class Qwen2MoeForCausalLM(_QwenMoeForCausalLM):
    ARCHITECTURE = "Qwen2MoeForCausalLM"
