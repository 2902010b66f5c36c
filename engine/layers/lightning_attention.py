"""Lightning attention: MiniMax-Text-01's and MiniMax-M1's linear attention (models/minimax.py), with a state cache that
rolls back.

Shapes: B batch, T new tokens, D hidden, H heads of hd features (this rank's), S the state [B, H, hd, hd].

    q, k, v = silu(qkv_proj(h)) per head              (each head's rows [q, k, v] next to each other)
per token t and head i, with a fixed decay slope s_i:
    S = exp(-s_i) S + k v^T;  o = S^T q
then o of every head RMS-normalised together, times sigmoid(output_gate(h)), and out_proj. The slopes fall
geometrically over the heads, 2^(-8 (i + 1) / H), and with depth: layer l of L scales them by 1 - l / (L - 1) (+1e-5),
as transformers computes them. That is layers/mamba2.py's scan with q = q, k = k, v = v and a log decay -s_i per
position: long inputs run it a chunk at a time, short ones token by token, which yields the state after every
position for the cache (`LinearStateCache`, no conv inputs: kernel 1).

Under tensor parallelism a rank holds H / tp_size heads (their qkv_proj and output_gate rows, their slopes), the norm's
mean square summed over the ranks, and out_proj's input columns, all-reduced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor import TensorParallel
from .gated_delta_net import StateMixer, continue_from
from .mamba2 import ssd
from .norm import RMSNorm


def slopes(n_heads: int, layer_id: int, n_layers: int) -> torch.Tensor:
    """Each head's decay slope [H] (float32) for layer `layer_id` of `n_layers`, as transformers' MiniMax computes it."""
    base = 1 / (2 ** (8 / n_heads))
    # explicit CPU: construction may run under a meta device context (the tables are computed, never loaded)
    rate = base ** (torch.arange(n_heads, dtype=torch.float32, device="cpu") + 1)
    return rate * (1 - layer_id / (n_layers - 1 + 1e-5) + 1e-5)


class LightningAttention(StateMixer):
    def __init__(self, hidden_size: int, n_heads: int, head_dim: int, layer_id: int, n_layers: int,
                 norm_eps: float = 1e-6, dtype: torch.dtype | None = None, tp: TensorParallel | None = None,
                 tp_rank: int = 0):
        """`norm_eps`: the output norm's (transformers builds it with its default 1e-6, not the config's
        rms_norm_eps). `tp_rank`: which heads this rank holds (the slopes are computed, not loaded)."""
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        self.H, self.hd = tp.split(n_heads, "num_attention_heads"), head_dim
        inner = self.H * head_dim
        self.qkv_proj = nn.Linear(hidden_size, 3 * inner, bias=False, dtype=dtype)
        self.output_gate = nn.Linear(hidden_size, inner, bias=False, dtype=dtype)
        self.norm = RMSNorm(inner, norm_eps, dtype) if tp.size == 1 else \
            RMSNorm(inner, norm_eps, dtype, full_dim=inner * tp.size, reduce=tp.reduce)
        self.out_proj = nn.Linear(inner, hidden_size, bias=False, dtype=dtype)
        heads = slice(tp_rank * self.H, (tp_rank + 1) * self.H)
        self.slope = slopes(n_heads, layer_id, n_layers)[heads].clone()                         # [H], not loaded
        self.state_layout = (1, 1, (self.H, self.hd, self.hd))   # its LinearStateCache's

    def forward(self, h: torch.Tensor, cos=None, sin=None, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, T, D] -> [B, T, D] (cos, sin: unused, no rotary here; input_pos [T] needed with a cache)."""
        B, T, _ = h.shape
        H, hd = self.H, self.hd
        cache = self.kv_cache
        start, _, state = continue_from(cache, input_pos, T, B, "lightning-attention", lambda: (
            None, h.new_zeros(B, H, hd, hd, dtype=torch.float32)))
        q, k, v = F.silu(self.qkv_proj(h)).view(B, T, H, 3 * hd).float().split(hd, dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                      # [B, H, T, hd]
        if self.slope.device != h.device:
            self.slope = self.slope.to(h.device)
        g = (-self.slope)[None, :, None].expand(B, H, T)                       # log decay per position
        o, states = ssd(q, k, v, g, state.float(), per_position=cache is not None and T <= cache.snapshots)
        if cache is not None:
            cache.write(start, h.new_zeros(B, 1, T), states)
        o = self.norm(o.transpose(1, 2).reshape(B, T, H * hd).to(h.dtype))
        return self.tp.output_projection(self.out_proj, torch.sigmoid(self.output_gate(h)) * o)
