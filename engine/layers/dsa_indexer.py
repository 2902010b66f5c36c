"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2): which keys each query attends to.

Shapes: B batch, T new tokens, S keys (the cache's, or the T tokens' own), H index heads, d index head dim,
r the rope dims (qk_rope_head_dim), L q_lora_rank.

    q = wq_b(q_resid)              [B, T, H, d]   from MLA's normalised query latent (q_a_layernorm(q_a_proj(x)))
    k = LayerNorm(wk(x))           [B, S, d]      one key per token, shared by the heads; cached per position
    rotate the first r features of q and k (V3.2: rotate-half pairs, unlike MLA's interleaved ones; GLM-5:
    interleaved pairs, `rope_interleave`)
    score[t, s] = sum_h w[t, h] relu(q[t, h] . k[s] / sqrt(d)),   w = weights_proj(x) / sqrt(H)
and each query keeps its `index_topk` best-scoring visible keys (all of them while it sees fewer), which
the attention then masks to. As transformers' DeepseekV32Indexer computes it: the reference's Hadamard
rotation of q and k leaves their dot products unchanged and its FP8 scoring is a precision optimisation,
both left out there and here.

Under tensor parallelism the indexer is whole on every rank (it selects keys for all heads alike).

GLM-5 may run the indexer on some layers only ("full"); each other layer ("shared") attends to the keys the
full layer before it selected in the same forward (`TopKSelection`), as transformers' GLM-MoE-DSA does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .rope import apply_rotary


class SparseIndexer(nn.Module):
    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int, topk: int,
                 dtype: torch.dtype | None = None, rope_interleave: bool = False):
        super().__init__()
        self.rope_interleave = rope_interleave
        if not 0 < rope_dim <= head_dim:
            raise ValueError(f"index_head_dim={head_dim} must hold qk_rope_head_dim={rope_dim}")
        if topk < 1:
            raise ValueError(f"index_topk={topk} must be >= 1")
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False, dtype=dtype)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False, dtype=dtype)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> the tokens' index keys [B, T, d] (rotated): what the cache keeps per position."""
        return self._rotate(self.k_norm(self.wk(x)), cos, sin)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """x [B, T, D], q_resid [B, T, L], keys [B, S, d], visible [T, S] (causal) -> kept [B, T, S]: True at the
        keys each query attends to (a subset of the visible ones)."""
        B, T, _ = x.shape
        q = self._rotate(self.wq_b(q_resid).view(B, T, self.n_heads, self.head_dim).transpose(1, 2),
                         cos, sin).transpose(1, 2)                                          # [B, T, H, d]
        scores = F.relu(q.float() @ keys.float().transpose(-1, -2).unsqueeze(1) * self.head_dim ** -0.5)  # [B,T,H,S]
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5                       # [B, T, H]
        index = (weights.unsqueeze(-2) @ scores).squeeze(-2)                                # [B, T, S]
        index = index.masked_fill(~visible, float("-inf"))
        chosen = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices               # [B, T, k]
        kept = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, chosen, True)
        return kept & visible

    def _rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The first rope_dim features of t [..., T, d] rotated, the rest as they are."""
        r = self.rope_dim
        return torch.cat([apply_rotary(t[..., :r], cos, sin, interleaved=self.rope_interleave), t[..., r:]], dim=-1)


class TopKSelection:
    """The keys the latest full layer of a forward selected, for the shared layers after it: the model's layers run
    in order, so a shared layer reads what the full layer before it kept (on this pipeline stage, or on an earlier
    one: the stages hand it on). A mask of another shape (no full layer ran before it in this forward) is refused."""

    def __init__(self):
        self.mask: torch.Tensor | None = None

    def keep(self, mask: torch.Tensor) -> None:
        """mask [B, 1, T, S]: the keys each query of the full layer attends to."""
        self.mask = mask

    def latest(self, B: int | None = None, T: int | None = None, S: int | None = None) -> torch.Tensor:
        """The latest selection [B, 1, T, S], checked to be of that shape when it is given."""
        mask = self.mask
        if mask is None or (B is not None and tuple(mask.shape) != (B, 1, T, S)):
            raise ValueError(f"a shared top-k layer needs the selection of a full layer run before it in this "
                             f"forward, [B={B}, 1, T={T}, S={S}]; found "
                             f"{None if mask is None else list(mask.shape)}")
        return mask
