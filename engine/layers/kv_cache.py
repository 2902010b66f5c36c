"""KV caches (gpt-fast style): preallocated [B, H_kv, S, head_dim] buffers.

`KVCache`: S_max slots, one per position. `update(input_pos [T], k, v)` writes the new
keys/values at their positions and returns the whole buffers; the attention masks
positions after the query's own.

`WindowKVCache`: a sliding-window layer's cache (Mixtral, gpt-oss's sliding layers): a
ring of `capacity` slots, so its memory grows with the window, not the sequence. A query
at position q sees keys (q - W, q], so a forward at positions [s, s + T) needs from
before it only (s - W, s). `update` returns the ring as it was (the positions before s)
followed by the new keys, with each key's position (-1: an empty slot, or one holding a
position >= s that a speculative round wrote and then rolled back, which the new keys
replace), and only then writes the last `capacity` new positions into their slots
(position p in slot p % capacity). A capacity of W serves generation; a caller that
rolls back (speculative decoding, k tokens ahead) needs W + k + 1, as `lookahead`
gives it. A forward whose needed positions were overwritten meanwhile is refused, not
run on the wrong keys.
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    def __init__(self, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, v_head_dim: int | None = None):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        v_shape = shape[:3] + (v_head_dim or head_dim,)   # values may be narrower than keys (MiMo-V2-Flash)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(v_shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.k_cache.shape[2]

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_pos [T], k/v [B, H_kv, T, hd] -> the full caches [B, H_kv, S_max, hd]."""
        B = k.shape[0]
        self.k_cache[:B, :, input_pos] = k
        self.v_cache[:B, :, input_pos] = v
        return self.k_cache[:B], self.v_cache[:B]


class WindowKVCache(nn.Module):
    def __init__(self, batch_size: int, n_kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, *, window: int, v_head_dim: int | None = None):
        super().__init__()
        if not 1 <= window <= capacity:
            raise ValueError(f"a window of {window} does not fit a ring of {capacity} slots")
        self.window = window
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        v_shape = shape[:3] + (v_head_dim or head_dim,)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(v_shape, dtype=dtype, device=device), persistent=False)
        # the position each slot holds; -1: none yet
        self.register_buffer("slot_pos", torch.full((capacity,), -1, dtype=torch.long, device=device),
                             persistent=False)

    @property
    def capacity(self) -> int:
        return self.k_cache.shape[2]

    def update(self, input_pos: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_pos [T] (consecutive), k/v [B, H_kv, T, hd] -> (keys, values [B, H_kv, C + T, hd], key positions
        [C + T]): the ring's keys of positions before input_pos[0], then the new ones."""
        B, T, C = k.shape[0], input_pos.numel(), self.capacity
        start = int(input_pos[0])
        if int(input_pos[-1]) - start != T - 1:
            raise ValueError(f"a sliding-window cache takes consecutive positions, got {input_pos.tolist()}")
        needed = torch.arange(max(0, start - self.window + 1), start, device=self.slot_pos.device)
        held = self.slot_pos[needed % C]
        if not torch.equal(held, needed):
            lost = int(needed[held != needed][0])
            raise RuntimeError(f"the sliding-window KV cache ({C} slots, window {self.window}) no longer holds "
                               f"position {lost}, which position {start} attends to: it was overwritten by a write "
                               f"further ahead; set up the caches with lookahead >= how far a round writes past "
                               f"the tokens it keeps")
        before = torch.where((self.slot_pos >= 0) & (self.slot_pos < start), self.slot_pos, -1)
        key_pos = torch.cat([before, input_pos.to(before.device)])
        keys = torch.cat([self.k_cache[:B], k], dim=2)
        values = torch.cat([self.v_cache[:B], v], dim=2)
        keep = input_pos[-C:].to(self.slot_pos.device)
        slots = keep % C
        self.k_cache[:B, :, slots] = k[:, :, -C:]
        self.v_cache[:B, :, slots] = v[:, :, -C:]
        self.slot_pos[slots] = keep
        return keys, values, key_pos
