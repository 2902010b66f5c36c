"""A static KV cache (gpt-fast style): preallocated [B, H_kv, S_max, head_dim] buffers.

`update(input_pos [T], k, v)` writes the new keys/values at their positions and
returns the whole buffers; the attention masks positions after the query's own.
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    def __init__(self, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.k_cache.shape[2]

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_pos [T], k/v [B, H_kv, T, hd] -> the full caches [B, H_kv, S_max, hd]."""
        B = k.shape[0]
        self.k_cache[:B, :, input_pos] = k
        self.v_cache[:B, :, input_pos] = v
        return self.k_cache[:B], self.v_cache[:B]
