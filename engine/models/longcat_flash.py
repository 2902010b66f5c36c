"""LongCat-Flash (`LongcatFlashForCausalLM`: Meituan's LongCat-Flash-Chat), following transformers'
modeling_longcat_flash.py numerically.

Shapes: B batch, T tokens, D hidden, E routed experts, Z zero-computation experts, K top-k.

Each of num_layers layers holds two sublayers and one MoE block fed by the first of them (the shortcut):
    h = x + attn0(in_norm0(x));   n = post_norm0(h);   s = moe(n);   h = h + mlp0(n)
    h = h + attn1(in_norm1(h));   out = h + mlp1(post_norm1(h)) + s
- Attention: DeepSeek's MLA (layers/mla.py) with a query latent, interleaved rope, and its latents scaled by
  sqrt(D / q_lora_rank) and sqrt(D / kv_lora_rank) (`latent_scales`). Each sublayer has its own KV cache.
- mlp0 / mlp1 (`mlps`): dense SwiGLU MLPs of ffn_hidden_size.
- MoE: a float32 softmax router (`router.classifier`) over E + Z outputs; the top K chosen by the scores plus
  e_score_correction_bias; their weights the scores times routed_scaling_factor (not renormalised). The E routed
  experts (engine/moe.py, expert_ffn_hidden_size wide) get the picks of ids < E; a pick of a zero-computation
  expert (id >= E) returns the token's input times its weight, computed on every rank and added after the routed
  experts' reduction (as an unfused shared expert would be); the routed experts see those picks masked (id -1:
  not dispatched, not counted by EPLB). No shared expert: nothing to fuse.
- Checkpoints: transformers' save_pretrained writes gate/up rows for the zero-computation experts too (its stacked
  gate_up_proj has E + Z rows, unused past E); `checkpoint_view` leaves those out. The Multi-Token-Prediction
  module (`model.mtp.*`) is not part of the model: skipped by name, as transformers skips it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from loadplan.layouts import longcat_flash_layout
from ..layers.mla import MLASpec, MultiHeadLatentAttention
from ..layers.mlp import GatedMLP, activation
from ..moe import RoutedExperts
from ..parallel.tensor import TensorParallel
from ..shown_tensors import ShownTensors
from .causal_lm import DecoderLayer
from .config import ConfigError, DecoderConfig, get_field as _get, moe_layout, read_rope
from .deepseek_v3 import LatentCausalLM

ARCHITECTURE = "LongcatFlashForCausalLM"


@dataclass(frozen=True)
class LongcatFlashConfig(DecoderConfig):
    ffn_hidden_size: int                # each dense MLP
    expert_ffn_hidden_size: int         # each routed expert
    # num_hidden_layers: config.num_layers: each layer two attention / MLP sublayers
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    hidden_act: str
    n_routed_experts: int
    zero_expert_num: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    moe_layers: tuple[int, ...]

    @property
    def num_experts(self) -> int:
        """The routed experts (DeclaredCausalLM's name for n_routed_experts; the zero experts are the router's)."""
        return self.n_routed_experts

    @classmethod
    def from_hf(cls, d: dict) -> "LongcatFlashConfig":
        """transformers' LongcatFlashConfig defaults where a config leaves a field out."""
        act = _get(d, "hidden_act", "silu", str)
        activation(act)   # refuses unknown activations by name
        # the registry's reader of the layer and expert fields: num_layers layers, all MoE; n_routed_experts and
        # moe_topk
        layout = moe_layout(longcat_flash_layout, d)
        if d.get("router_bias"):
            raise ConfigError("config.router_bias: true not supported; transformers' LongCat-Flash routes without a "
                              "bias (it loads one and does not add it): supported: false")
        nope, rot = _get(d, "qk_nope_head_dim", 128, int), _get(d, "qk_rope_head_dim", 64, int)
        if d.get("qk_head_dim") is not None and d["qk_head_dim"] != nope + rot:
            raise ConfigError(f"config.qk_head_dim: {d['qk_head_dim']!r} must be qk_nope_head_dim + qk_rope_head_dim "
                              f"= {nope + rot}")
        if _get(d, "head_dim", 64, int) != rot:
            raise ConfigError(f"config.head_dim: {d.get('head_dim', 64)!r} must equal qk_rope_head_dim={rot} "
                              f"(transformers' rotary tables are head_dim wide)")
        # The zero-computation experts are not in the layout (EP does not place them); the reader checked the count.
        zero = _get(d, "zero_expert_num", 256, int)
        q_lora_rank = _get(d, "q_lora_rank", 1536, int)
        kv_lora_rank = _get(d, "kv_lora_rank", 512, int)
        if q_lora_rank < 1 or kv_lora_rank < 1:
            bad = "q_lora_rank" if q_lora_rank < 1 else "kv_lora_rank"
            raise ConfigError(f"config.{bad}: must be >= 1 (LongCat-Flash always has both latents), got {d[bad]}")
        if d.get("rope_interleave") is False:
            raise ConfigError("config.rope_interleave: False not supported; LongCat-Flash rotates interleaved pairs")
        return cls(
            vocab_size=_get(d, "vocab_size", 131072, int),
            hidden_size=_get(d, "hidden_size", 6144, int),
            ffn_hidden_size=_get(d, "ffn_hidden_size", 12288, int),
            expert_ffn_hidden_size=_get(d, "expert_ffn_hidden_size", 2048, int),
            num_hidden_layers=len(layout.layer_ids),
            num_attention_heads=_get(d, "num_attention_heads", 64, int),
            q_lora_rank=q_lora_rank,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rot,
            v_head_dim=_get(d, "v_head_dim", 128, int),
            rope=read_rope(d),
            attention_bias=bool(_get(d, "attention_bias", False, bool)),
            max_position_embeddings=_get(d, "max_position_embeddings", 131072, int),
            rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-5)),
            hidden_act=act,
            tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False, bool)),
            n_routed_experts=layout.n_routed,
            zero_expert_num=zero,
            num_experts_per_tok=layout.top_k,
            routed_scaling_factor=float(_get(d, "routed_scaling_factor", 6.0)),
            moe_layers=layout.moe_layers,
        )


class LongcatRouter(nn.Module):
    """x [T, D] -> (ids [T, K] of E + Z, weights [T, K] float32): softmax scores (float32), the top K of them plus
    e_score_correction_bias, their scores times routed_scaling_factor."""

    def __init__(self, hidden_size: int, n_outputs: int, top_k: int, routed_scaling_factor: float):
        super().__init__()
        self.top_k, self.routed_scaling_factor = top_k, routed_scaling_factor
        # float32 like the reference keeps them: near-tied scores decide the experts
        self.classifier = nn.Linear(hidden_size, n_outputs, bias=False, dtype=torch.float32)
        self.register_buffer("e_score_correction_bias", torch.zeros(n_outputs, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.softmax(self.classifier(x.float()), dim=-1)                                  # [T, E+Z]
        ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices  # [T, K]
        return ids, scores.gather(1, ids) * self.routed_scaling_factor


class LongcatFlashMoE(nn.Module):
    """router, experts (the routed ones); the zero-computation experts' picks return their input, weighted."""

    def __init__(self, cfg: LongcatFlashConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.n_routed = cfg.n_routed_experts
        self.router = LongcatRouter(cfg.hidden_size, cfg.n_routed_experts + cfg.zero_expert_num,
                                    cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.expert_ffn_hidden_size, plan,
                                     layer_id=layer_id, dtype=dtype)
        if self.experts.num_fused_shared_experts:
            raise ValueError(f"layer {layer_id}: plan fuses a shared expert but LongCat-Flash has none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        ids, weights = self.router(x)                                        # [T, K]
        zero = ids >= self.n_routed                                          # the zero-computation experts' picks
        y = self.experts(x, ids.masked_fill(zero, -1), weights.masked_fill(zero, 0).to(x.dtype))   # reduced
        return y + (weights * zero).sum(dim=-1, keepdim=True).to(x.dtype) * x


class AttentionPair(nn.ModuleList):
    """A layer's two attention sublayers as one token mixer for the model's cache set-up (`setup_cache`,
    `kv_cache`): each keeps its own cache."""

    def setup_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype, device, lookahead: int = 0):
        return [attn.setup_cache(batch_size, max_seq_len, dtype, device, lookahead) for attn in self]

    @property
    def kv_cache(self):
        caches = [attn.kv_cache for attn in self]
        return None if all(c is None for c in caches) else caches

    @kv_cache.setter
    def kv_cache(self, value) -> None:
        if value is not None:
            raise ValueError("set the sublayers' caches with setup_cache")
        for attn in self:
            attn.kv_cache = None


class LongcatFlashDecoderLayer(DecoderLayer):
    def __init__(self, cfg: LongcatFlashConfig, plan, layer_id: int, dtype: torch.dtype):
        nn.Module.__init__(self)
        tp = TensorParallel.of(plan)   # heads and dense features split over the TP ranks (the experts: RoutedExperts)
        self.layer_id = layer_id
        scales = ((cfg.hidden_size / cfg.q_lora_rank) ** 0.5, (cfg.hidden_size / cfg.kv_lora_rank) ** 0.5)
        self.self_attn = AttentionPair(MultiHeadLatentAttention(MLASpec.of(cfg, latent_scales=scales), tp=tp,
                                                                dtype=dtype) for _ in range(2))
        self.mlps = nn.ModuleList(GatedMLP(cfg.hidden_size, cfg.ffn_hidden_size, cfg.hidden_act, dtype, tp=tp)
                                  for _ in range(2))
        self.mlp = LongcatFlashMoE(cfg, plan, layer_id, dtype)
        self.input_layernorm = nn.ModuleList(self.NORM(cfg.hidden_size, cfg.rms_norm_eps, dtype) for _ in range(2))
        self.post_attention_layernorm = nn.ModuleList(self.NORM(cfg.hidden_size, cfg.rms_norm_eps, dtype)
                                                      for _ in range(2))
        self.rotary = None

    def forward(self, x, cos, sin, input_pos=None):
        """x [B, T, D] -> [B, T, D]"""
        B, T, D = x.shape
        x = x + self.self_attn[0](self.input_layernorm[0](x), cos, sin, input_pos)
        n = self.post_attention_layernorm[0](x).reshape(B * T, D)
        shortcut = self.mlp(n).view(B, T, D)
        x = x + self.mlps[0](n).view(B, T, D)
        x = x + self.self_attn[1](self.input_layernorm[1](x), cos, sin, input_pos)
        return x + self.mlps[1](self.post_attention_layernorm[1](x)) + shortcut


_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up)_proj\.weight$")


class LongcatFlashForCausalLM(LatentCausalLM):
    ARCHITECTURE = ARCHITECTURE
    MTP_PREFIXES = ("model.mtp.",)
    CONFIG = LongcatFlashConfig
    DECODER_LAYER = LongcatFlashDecoderLayer


    def checkpoint_view(self, ckpt):
        """The checkpoint without the gate/up rows transformers writes for the zero-computation experts (ids E to
        E + Z - 1: no down projection, no computation). Any other expert id past E is shown, and refused."""
        cfg = self.config
        zero = range(cfg.n_routed_experts, cfg.n_routed_experts + cfg.zero_expert_num)
        every = ckpt.names()
        names = [n for n in every if not ((m := _EXPERT.search(n)) and int(m.group(1)) in zero)]
        if len(names) == len(every):
            return ckpt
        view = ShownTensors(ckpt)
        for name in names:
            view.show(name, name)
        return view
