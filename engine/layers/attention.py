"""Grouped-query attention, with an optional static KV cache; what a family's attention is, is an `AttentionSpec`.

The spec's departures from plain GQA, and the families that take them:
- `qkv_bias` / `o_bias`: biases on q/k/v (Qwen2-MoE, GLM-4-MoE) and on o_proj (Qwen3's attention_bias).
- `qk_norm`: RMSNorm on q and k: "head", on each head before the rotary embedding (Qwen3-MoE); "head_after_rope",
  on the rotated q and k (Hunyuan A13B); "projection", one norm over the whole q projection and one over the whole
  k projection (OLMoE: `q_proj_norm`, `k_proj_norm`; under TP each rank holds its heads' part of the weight and the
  mean of squares is summed over the TP group). `norm`: the norms' class (Qwen3-Next's `OffsetRMSNorm`,
  FlexOlmo's `WeightFirstRMSNorm`: layers/norm.py). `clip_qkv`: q, k and v clamped to +-clip_qkv (OLMoE).
- `rotary_dim`: partial rotary, only the first rotary_dim features of each head are rotated (GLM-4-MoE), as
  transformers' apply_rotary_pos_emb does when cos/sin are narrower than the head; `rope_interleave`: the rotary
  embedding turns (even, odd) pairs instead of the two halves (ERNIE-4.5; layers/rope.py: the output comes out
  de-interleaved, the same permutation for q and k, whose dot products it leaves unchanged); `use_rope=False`:
  NoPE, q and k not rotated (EXAONE-MoE's and AFMoE's global layers).
- `sliding_window` W: a query at position i sees keys j with i - W < j <= i (Mixtral; transformers'
  sliding_window_causal_mask_function).
- `sinks`: one learned logit per head that joins every query's softmax as an extra key with no value (its share of
  the probability is dropped: transformers' eager_attention_forward; gpt-oss).
- `gate`: the attention output scaled by an output gate before o_proj: "in_q", q_proj writes each head's query and
  then as many gate features (the head's rows [q, gate] next to each other; Qwen3-Next); "projection", a projection
  of its own, H x head_dim features split with the heads (AFMoE); "per_head", that projection's H features, one
  gate a head (Step-3.5). `gate_activation`: sigmoid, or softplus in float32 (Laguna).
- `v_head_dim`: values (and the output per head) narrower than queries and keys, `v_scale`: the values scaled as
  they are projected (MiMo-V2-Flash); `scale`: the softmax scale when it is not head_dim ** -0.5 (Step-3.5's
  query_pre_attn_scalar ** -0.5, Granite's attention_multiplier).
Under tensor parallelism (`tp`, engine/parallel/tensor.py) a rank holds H / tp_size heads
and H_kv / tp_size key/value heads (q/k/v split by output features, o_proj by input
features): its o_proj output is a partial sum, all-reduced over the TP group before
o_proj's bias is added (once).
Shapes: B batch, T new tokens, H heads, H_kv key/value heads (this rank's), hd head_dim, rd rotary_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor import TensorParallel
from .kv_cache import KVCache, WindowKVCache
from .norm import RMSNorm
from .rope import apply_rotary

# The output gate's activation: sigmoid (every gated family's), or softplus in float32 (Laguna's)
GATE_ACTIVATIONS = {"sigmoid": torch.sigmoid, "softplus": lambda g: F.softplus(g.float()).to(g.dtype)}
QK_NORMS = (None, "head", "head_after_rope", "projection")
GATES = (None, "in_q", "projection", "per_head")


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's grouped-query attention (the module doc says which family takes which departure)."""

    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None                 # QK_NORMS
    norm: type[RMSNorm] = RMSNorm
    clip_qkv: float | None = None
    rotary_dim: int | None = None              # None: the whole head
    rope_interleave: bool = False
    use_rope: bool = True
    sliding_window: int | None = None
    sinks: bool = False
    gate: str | None = None                    # GATES
    gate_activation: str = "sigmoid"
    v_head_dim: int | None = None              # None: head_dim
    v_scale: float = 1.0
    scale: float | None = None                 # None: head_dim ** -0.5

    @classmethod
    def of(cls, cfg, **departures) -> "AttentionSpec":
        """The attention of a family config naming hidden_size, num_attention_heads, num_key_value_heads, head_dim and
        rms_norm_eps, with the family's `departures` from plain GQA."""
        return cls(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps,
                   **departures)

    def __post_init__(self):
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r}: one of {QK_NORMS}")
        if self.gate not in GATES:
            raise ValueError(f"gate={self.gate!r}: one of {GATES}")
        if self.gate_activation not in GATE_ACTIVATIONS:
            raise ValueError(f"gate_activation={self.gate_activation!r}: one of {', '.join(GATE_ACTIVATIONS)}")
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            raise ValueError(f"clip_qkv={self.clip_qkv} must be > 0")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"num_attention_heads={self.n_heads} is not a multiple of "
                             f"num_key_value_heads={self.n_kv_heads}")
        rd = self.rotary_dim or self.head_dim
        if not (0 < rd <= self.head_dim and rd % 2 == 0):
            raise ValueError(f"rotary_dim={rd} must be even and in (0, head_dim={self.head_dim}]")
        if self.gate is not None and (self.v_head_dim or self.head_dim) != self.head_dim:
            raise ValueError("an output gate needs values as wide as the heads (v_head_dim == head_dim)")


class GQAttention(nn.Module):
    def __init__(self, spec: AttentionSpec, *, tp: TensorParallel | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.spec = spec
        D, head_dim, eps, norm = spec.hidden_size, spec.head_dim, spec.rms_norm_eps, spec.norm
        self.clip_qkv, self.sliding_window = spec.clip_qkv, spec.sliding_window
        self.tp = tp = tp or TensorParallel()
        full_q, full_k = spec.n_heads * head_dim, spec.n_kv_heads * head_dim
        n_heads = tp.split(spec.n_heads, "num_attention_heads")
        n_kv_heads = tp.split(spec.n_kv_heads, "num_key_value_heads")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rotary_dim = spec.rotary_dim or head_dim
        self.v_head_dim = v_head_dim = spec.v_head_dim or head_dim
        self.v_scale, self.rope_interleave, self.use_rope = spec.v_scale, spec.rope_interleave, spec.use_rope
        self.scale = head_dim ** -0.5 if spec.scale is None else spec.scale
        self.output_gate = spec.gate == "in_q"
        q_width = n_heads * head_dim * (2 if self.output_gate else 1)   # a head's rows: its query, then its gate
        self.q_proj = nn.Linear(D, q_width, bias=spec.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(D, n_kv_heads * head_dim, bias=spec.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(D, n_kv_heads * v_head_dim, bias=spec.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(n_heads * v_head_dim, D, bias=spec.o_bias, dtype=dtype)
        self.gate_per_head = spec.gate == "per_head"
        self.gate_activation = spec.gate_activation
        self.gate_proj = None
        if spec.gate in ("projection", "per_head"):
            self.gate_proj = nn.Linear(D, n_heads * (1 if self.gate_per_head else head_dim), bias=False, dtype=dtype)
        per_head = spec.qk_norm in ("head", "head_after_rope")
        self.qk_norm_after_rope = spec.qk_norm == "head_after_rope"
        self.q_norm = norm(head_dim, eps, dtype) if per_head else None
        self.k_norm = norm(head_dim, eps, dtype) if per_head else None
        self.q_proj_norm = self.k_proj_norm = None
        if spec.qk_norm == "projection":
            split = lambda full: dict(full_dim=full, reduce=tp.reduce) if tp.size > 1 else {}  # noqa: E731
            self.q_proj_norm = norm(n_heads * head_dim, eps, dtype, **split(full_q))
            self.k_proj_norm = norm(n_kv_heads * head_dim, eps, dtype, **split(full_k))
        # [H] this rank's heads' sink logits (TP splits them with the heads)
        self.sinks = nn.Parameter(torch.empty(n_heads, dtype=dtype), requires_grad=False) if spec.sinks else None
        self.kv_cache: KVCache | None = None   # set by the model's setup_caches
        # Chunked local attention (Llama 4's rope layers): a query sees the keys of its own chunk of this many
        # positions only. A family sets it after construction, with `_after_rotary` (models/llama4.py).
        self.chunk_size: int | None = None

    def setup_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype, device: torch.device | str,
                    lookahead: int = 0) -> KVCache | WindowKVCache:
        """A cache for `max_seq_len` positions: with a sliding window, a ring of window + `lookahead` slots when
        that is fewer (`lookahead`: how far past the tokens it keeps a caller writes, e.g. speculative rounds)."""
        W = self.sliding_window
        if W is not None and W + lookahead < max_seq_len:
            self.kv_cache = WindowKVCache(batch_size, self.n_kv_heads, W + lookahead, self.head_dim, dtype, device,
                                          window=W, v_head_dim=self.v_head_dim)
        else:
            self.kv_cache = KVCache(batch_size, self.n_kv_heads, max_seq_len, self.head_dim, dtype, device,
                                    v_head_dim=self.v_head_dim)
        return self.kv_cache

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D], cos/sin [T, rd], input_pos [T] (needed with a cache) -> [B, T, D]."""
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)          # [B, T, H * hd], [B, T, H_kv * hd] x2
        gate = None
        if self.output_gate:                                               # [B, T, H, 2 * hd]: each head's q, gate
            q, gate = q.view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(B, T, -1), gate.reshape(B, T, -1)         # [B, T, H * hd] each
        elif self.gate_proj is not None:
            gate = self.gate_proj(x)                                       # [B, T, H * hd], or [B, T, H] a head
            if self.gate_per_head:
                gate = gate.repeat_interleave(self.v_head_dim, dim=-1)     # [B, T, H * hd]
        if self.q_proj_norm is not None:
            q, k = self.q_proj_norm(q), self.k_proj_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(B, T, self.n_heads, self.head_dim)                      # [B, T, H, hd]
        k = k.view(B, T, self.n_kv_heads, self.head_dim)                   # [B, T, H_kv, hd]
        v = v.view(B, T, self.n_kv_heads, self.v_head_dim)
        if self.v_scale != 1.0:
            v = v * self.v_scale
        if self.q_norm is not None and not self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, hd]
        if self.use_rope:
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        if self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._after_rotary(q, k, input_pos if input_pos is not None else torch.arange(T, device=x.device))
        gqa = self.n_heads != self.n_kv_heads
        mask = None                                                        # [T, S] where a mask is needed
        if self.kv_cache is not None:
            if input_pos is None:
                raise ValueError("a KV cache is set up: pass input_pos")
            if isinstance(self.kv_cache, WindowKVCache):
                k, v, key_pos = self.kv_cache.update(input_pos, k, v)     # [B, H_kv, C + T, hd], [C + T]
            else:
                k, v = self.kv_cache.update(input_pos, k, v)              # [B, H_kv, S_max, hd]
                key_pos = torch.arange(k.shape[2], device=x.device)
            mask = self._mask(input_pos, key_pos)
        elif self.sinks is not None or any(n is not None and T > n for n in (self.sliding_window, self.chunk_size)):
            pos = torch.arange(T, device=x.device)
            mask = self._mask(pos, pos)
        if self.sinks is not None:
            y = self._attend_with_sinks(q, k, v, mask)
        elif mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=self.scale, enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.v_head_dim)   # [B, T, H * dv]
        if gate is not None:
            y = y * GATE_ACTIVATIONS[self.gate_activation](gate)
        return self.tp.output_projection(self.o_proj, y)                    # [B, T, D]: every rank's heads

    def _attend_with_sinks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, hd], k/v [B, H_kv, S, hd], mask [T, S] -> [B, H, T, hd]: softmax over the visible
        keys and the head's sink logit, whose column is then dropped (so a row sums to less than 1)."""
        B, H, T, _ = q.shape
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)   # [B, H, S, hd]
        scores = (q @ k.transpose(-1, -2) * self.scale).masked_fill(~mask, float("-inf"))   # [B, H, T, S]
        sink = self.sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, T, 1)         # [B, H, T, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]      # [B, H, T, S]
        return probs @ v

    def _mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """[T, S] True where the query at query_pos[t] sees the key at key_pos[s]: causal, within the window
        (a key position of -1 is an empty slot: seen by no query)."""
        keys = key_pos.to(query_pos.device)[None, :]                        # [1, S]
        pos = query_pos[:, None]                                            # [T, 1]
        mask = (keys <= pos) & (keys >= 0)
        if self.sliding_window is not None:
            mask &= keys > pos - self.sliding_window
        if self.chunk_size is not None:
            mask &= torch.div(keys, self.chunk_size, rounding_mode="floor") == \
                torch.div(pos, self.chunk_size, rounding_mode="floor")
        return mask

    def _after_rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q [B, H, T, hd], k [B, H_kv, T, hd] after the rotation, positions [T] -> (q, k): as they are here; a
        family that changes them there overrides it (Llama 4's L2 norm and temperature, models/llama4.py)."""
        return q, k

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, hd]: its first rotary_dim features rotated, the others as they are."""
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, cos, sin, interleaved=self.rope_interleave)
        rd = self.rotary_dim
        return torch.cat([apply_rotary(x[..., :rd], cos, sin, interleaved=self.rope_interleave), x[..., rd:]], dim=-1)
