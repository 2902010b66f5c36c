"""LFM2's gated short convolution, a token mixer in place of attention on some layers (models/lfm2_moe.py).

Shapes: B batch, T new tokens, D hidden, K kernel.

    B, C, x = in_proj(h) split in three   (each [B, D, T])
    y = out_proj(C * causal_depthwise_conv(B * x))

The convolution sees the K - 1 positions before each token. With a cache (`setup_cache`, for decoding) those are
the gated inputs B * x of the previous positions, kept by position in layers/gated_delta_net.py's
`LinearStateCache` (its conv ring; no recurrent state here): a forward may continue from any position the cache
still holds, so a speculative round that keeps fewer tokens than it wrote continues where it kept them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gated_delta_net import StateMixer, continue_from

NO_STATE = (0,)    # the cache's per-position state: nothing but the conv inputs is carried


class ShortConv(StateMixer):
    def __init__(self, hidden_size: int, kernel: int, bias: bool, dtype: torch.dtype | None = None):
        super().__init__()
        if kernel < 1:
            raise ValueError(f"conv kernel {kernel} must be >= 1")
        self.hidden_size, self.kernel = hidden_size, kernel
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias, dtype=dtype)
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel, groups=hidden_size, bias=bias,
                              dtype=dtype)                                        # weight [D, 1, K]
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias, dtype=dtype)
        self.state_layout = (self.hidden_size, self.kernel, NO_STATE)   # its LinearStateCache's

    def forward(self, x: torch.Tensor, cos=None, sin=None, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D] (cos, sin: unused, no rotary here; input_pos [T] needed with a cache)."""
        B, T, D = x.shape
        gate_in, gate_out, value = self.in_proj(x).transpose(1, 2).chunk(3, dim=1)      # [B, D, T] each
        mixed = gate_in * value                                                          # [B, D, T]
        cache = self.kv_cache
        start, prefix, _ = continue_from(cache, input_pos, T, B, "short-conv",
                                         lambda: (mixed.new_zeros(B, D, self.kernel - 1), None))   # [B, D, K-1]
        weight = self.conv.weight
        conv = F.conv1d(torch.cat([prefix, mixed], dim=-1).to(weight.dtype), weight, self.conv.bias,
                        groups=D).to(mixed.dtype)                                        # [B, D, T]
        if cache is not None:
            # One (empty) state per position written, as far as the cache keeps them: a later forward may continue
            # from any of those positions.
            cache.write(start, mixed, mixed.new_zeros(min(T, cache.snapshots), B, *NO_STATE))
        return self.out_proj((gate_out * conv).transpose(1, 2))                         # [B, T, D]
