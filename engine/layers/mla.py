"""Multi-head Latent Attention (DeepSeek-V2/V3).

Queries come from a low-rank path (q_a_proj -> RMSNorm -> q_b_proj) or, when
`q_lora_rank` is null, from one q_proj. Keys and values share one compressed latent
(kv_a_proj_with_mqa -> [kv_lora_rank | qk_rope_head_dim]); the rope part is one
key head shared by all query heads, the rest is normalised and expanded per head by
kv_b_proj into [k_nope | v]. With `use_rope` False (Kimi-Linear) that shared part is not rotated; with
`latent_scales` (LongCat-Flash) the query and the normalised latent are multiplied by their factors; with
`output_gate` (the Ling 3 models) each head's output is scaled by sigmoid(g_proj(x)) of its own; with
`query_position_scale` (Mistral 4) each query is scaled by a factor that grows with its position past the rope's
original context.

Parameter names equal the checkpoint's names under `self_attn.`, so loading is a copy.
The KV cache keeps the compressed latent (kv_lora_rank + qk_rope_head_dim numbers
per token instead of heads * (qk_head_dim + v_head_dim)) and re-expands it each step:
simple, exact, and the memory saving MLA exists for. Like the engine's other
attention, the cache is an attribute the model sets up (`setup_cache`), and a
forward with a cache takes the positions `input_pos` of its tokens.

DeepSeek-V3.2 adds DeepSeek Sparse Attention (`indexer`, layers/dsa_indexer.py): each query attends
only to the keys its lightning indexer picks, scored from the query latent and one index key per token
(kept in the cache beside the latent). GLM-5 may let a layer without an indexer (`reuses_selection`)
attend to the keys the full layer before it picked (`selection`, shared by the model's layers).

Under tensor parallelism (`tp`, engine/parallel/tensor.py) a rank holds num_heads / tp_size
query heads: q_proj / q_b_proj and kv_b_proj are split by output rows (whole heads), o_proj
by input columns; the latent projections (q_a_proj, kv_a_proj_with_mqa) and their norms are
whole on every rank, and so is the latent cache. o_proj's output is all-reduced over the TP
group before its bias is added (once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor import TensorParallel
from .dsa_indexer import SparseIndexer, TopKSelection
from .norm import RMSNorm
from .rope import RopeConfig, apply_rotary, softmax_scale


class LatentKVCache(nn.Module):
    """Static per-layer cache (gpt-fast style) of the normalised latent and the rotated shared key.

    `update(input_pos [T], kv [B, T, kv_lora_rank], k_rot [B, T, qk_rope_head_dim])` writes
    the new entries at their positions and returns the buffers up to the last written one;
    `update_index` the same for the sparse indexer's keys, when the layer has one (`index_dim`).
    """

    def __init__(self, batch_size: int, max_seq_len: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, index_dim: int = 0):
        super().__init__()
        self.register_buffer("kv_cache", torch.zeros(batch_size, max_seq_len, kv_lora_rank, dtype=dtype,
                                                     device=device), persistent=False)
        self.register_buffer("k_rot_cache", torch.zeros(batch_size, max_seq_len, qk_rope_head_dim, dtype=dtype,
                                                        device=device), persistent=False)
        self.register_buffer("index_cache", torch.zeros(batch_size, max_seq_len, index_dim, dtype=dtype,
                                                        device=device), persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.kv_cache.shape[1]

    def update(self, input_pos: torch.Tensor, kv: torch.Tensor,
               k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B = kv.shape[0]
        self.kv_cache[:B, input_pos] = kv
        self.k_rot_cache[:B, input_pos] = k_rot
        # Expanding the latent costs per key: skip the never-written tail of the buffer.
        end = int(input_pos.max()) + 1
        return self.kv_cache[:B, :end], self.k_rot_cache[:B, :end]

    def update_index(self, input_pos: torch.Tensor, keys: torch.Tensor, end: int) -> torch.Tensor:
        """The index keys of positions [0, end) once `keys` are written at `input_pos` (`end`: what `update`
        returned the latent of, so the positions' end is not read back from the device again)."""
        B = keys.shape[0]
        self.index_cache[:B, input_pos] = keys
        return self.index_cache[:B, :end]


@dataclass(frozen=True)
class MLASpec:
    """One layer's Multi-head Latent Attention: its sizes (DeepSeek's config fields) and its departures."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None          # None: one q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig
    rope_interleave: bool = True
    attention_bias: bool = False
    use_rope: bool = True            # False: the qk_rope_head_dim features are not rotated (Kimi-Linear's NoPE MLA)
    latent_scales: tuple[float, float] = (1.0, 1.0)   # (query, normalised key/value latent): LongCat-Flash's
    output_gate: bool = False        # each head's output times sigmoid(g_proj(x)) of its own (the Ling 3 models)

    @classmethod
    def of(cls, cfg, **departures) -> "MLASpec":
        """The spec of a config that names DeepSeek's MLA fields (hidden_size, num_attention_heads, q_lora_rank,
        kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope, attention_bias)."""
        return cls(cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                   cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.rope, attention_bias=cfg.attention_bias, **departures)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, spec: MLASpec, *, tp: TensorParallel | None = None, dtype: torch.dtype | None = None,
                 indexer: SparseIndexer | None = None, reuses_selection: bool = False):
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        hidden_size, q_lora_rank, kv_lora_rank = spec.hidden_size, spec.q_lora_rank, spec.kv_lora_rank
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        attention_bias = spec.attention_bias
        self.num_heads = num_heads = tp.split(spec.num_heads, "num_attention_heads")    # this rank's heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rope_interleave = spec.rope_interleave
        self.use_rope = spec.use_rope
        self.q_scale, self.kv_scale = spec.latent_scales
        self.scale = softmax_scale(self.qk_head_dim, spec.rope)

        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * self.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=attention_bias, dtype=dtype)
            # The latent norms use the reference's fixed eps (1e-6), not config.rms_norm_eps.
            self.q_a_layernorm = RMSNorm(q_lora_rank, 1e-6, dtype)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=attention_bias,
                                            dtype=dtype)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, 1e-6, dtype)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False,
                                   dtype=dtype)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=attention_bias, dtype=dtype)
        self.g_proj = nn.Linear(hidden_size, num_heads, bias=False, dtype=dtype) if spec.output_gate else None
        if indexer is not None and q_lora_rank is None:
            raise ValueError("a sparse indexer reads the query latent: q_lora_rank is needed")
        self.indexer = indexer                       # whole on every TP rank
        if indexer is not None and reuses_selection:
            raise ValueError("a layer either runs its own indexer or reuses another layer's selection")
        self.reuses_selection = reuses_selection
        # The model's TopKSelection (layers/dsa_indexer.py), when some of its layers reuse another's selection: a
        # layer with an indexer writes its selection there, a layer that reuses one reads it.
        self.selection: TopKSelection | None = None
        self.kv_cache: LatentKVCache | None = None  # set by the model's setup_caches
        # Mistral 4's (beta, original_max_position_embeddings): the query at position p times
        # 1 + beta * log(1 + floor(p / original)) (Llama 4's long-context scaling). A family sets it after construction.
        self.query_position_scale: tuple[float, int] | None = None

    def setup_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                    device: torch.device | str, lookahead: int = 0) -> LatentKVCache:
        """One slot per position (no window here, so `lookahead` changes nothing)."""
        self.kv_cache = LatentKVCache(batch_size, max_seq_len, self.kv_lora_rank, self.qk_rope_head_dim,
                                      dtype, device, self.indexer.head_dim if self.indexer is not None else 0)
        return self.kv_cache

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], rope: RopeConfig,
                       dtype: torch.dtype | None = None) -> "MultiHeadLatentAttention":
        return cls(MLASpec(cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("q_lora_rank"), cfg["kv_lora_rank"],
                           cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], rope,
                           rope_interleave=cfg.get("rope_interleave", True),
                           attention_bias=cfg.get("attention_bias", False)), dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D], cos/sin [T, qk_rope_head_dim], input_pos [T] (needed with a cache) -> [B, T, D]."""
        B, T, _ = x.shape
        H = self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))                  # [B, T, q_lora_rank]
            q = self.q_b_proj(q_resid)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q = q.view(B, T, H, self.qk_head_dim).transpose(1, 2)  # [B, H, T, qk]
        q_nope, q_rot = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        if self.use_rope:
            q_rot = apply_rotary(q_rot, cos, sin, interleaved=self.rope_interleave)

        kv, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_a_layernorm(kv)
        if self.kv_scale != 1.0:
            kv = kv * self.kv_scale                                       # before the cache: keys and values alike
        if self.use_rope:
            k_rot = apply_rotary(k_rot, cos, sin, interleaved=self.rope_interleave)  # [B, T, r], one shared head

        mask = None                                                      # [T, S] or [B, 1, T, S]
        index_keys = self.indexer.keys(x, cos, sin) if self.indexer is not None else None   # [B, T, d]
        if self.kv_cache is not None:
            if input_pos is None:
                raise ValueError("a KV cache is set up: pass input_pos")
            kv, k_rot = self.kv_cache.update(input_pos, kv, k_rot)  # [B, S, ...]
            mask = torch.arange(kv.shape[1], device=x.device)[None, :] <= input_pos[:, None]  # [T, S]
            if index_keys is not None:
                index_keys = self.kv_cache.update_index(input_pos, index_keys, kv.shape[1])   # [B, S, d]
        S = kv.shape[1]
        if self.indexer is not None:
            visible = mask if mask is not None else torch.ones(T, S, dtype=torch.bool, device=x.device).tril()
            mask = self.indexer(x, q_resid, cos, sin, index_keys, visible)[:, None]     # [B, 1, T, S]
            if self.selection is not None:
                self.selection.keep(mask)
        elif self.reuses_selection:
            if self.selection is None:
                raise ValueError("this layer reuses the previous full layer's top-k, but no selection is shared "
                                 "with it (the model sets `selection`)")
            mask = self.selection.latest(B, T, S)                                        # [B, 1, T, S]

        kv = self.kv_b_proj(kv).view(B, S, H, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot[:, None].expand(B, H, S, self.qk_rope_head_dim)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        if self.query_position_scale is not None:
            beta, original = self.query_position_scale
            pos = (input_pos if input_pos is not None else torch.arange(T, device=x.device)).float()
            q = q * (1 + beta * torch.log(1 + torch.floor(pos / original))).to(q.dtype)[:, None]   # [T, 1]
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        out = out.transpose(1, 2)                                          # [B, T, H, v]
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(x).float()).to(out.dtype)[..., None]
        out = out.reshape(B, T, H * self.v_head_dim)                       # [B, T, H * v]
        return self.tp.output_projection(self.o_proj, out)                 # [B, T, D]: every rank's heads
