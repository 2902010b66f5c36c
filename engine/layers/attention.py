"""Grouped-query attention of the Qwen MoE families, with an optional static KV cache.

Qwen2-MoE: bias on q/k/v (`qkv_bias`). Qwen3-MoE: bias on q/k/v/o (`attention_bias`)
and RMSNorm on each head of q and k before the rotary embedding (`qk_norm`).
GLM-4-MoE: bias on q/k/v, optional qk_norm, and partial rotary: only the first
`rotary_dim` features of each head are rotated (the rest pass through), as
transformers' apply_rotary_pos_emb does when cos/sin are narrower than the head.
Mixtral: `sliding_window` W, a query at position i sees keys j with i - W < j <= i
(transformers' sliding_window_causal_mask_function).
gpt-oss: `sinks`, one learned logit per head that joins every query's softmax as an extra key
with no value (its share of the probability is dropped: transformers' eager_attention_forward),
and a window on every other layer (each layer is built with its own `sliding_window`).
Qwen3-Next: `output_gate`, q_proj writes each head's query and then as many gate features (the head's
rows [q, gate] next to each other), and the attention output is scaled by sigmoid(gate) before o_proj;
its q/k norms are `norm=OffsetRMSNorm` (layers/norm.py).
ERNIE-4.5: `rope_interleave`, the rotary embedding turns (even, odd) feature pairs instead of the two
halves (layers/rope.py: the output comes out de-interleaved, the same permutation for q and k, whose
dot products it leaves unchanged).
MiMo-V2-Flash: `v_head_dim`, values (and the attention's output per head) narrower than queries and keys, and
`v_scale`, the values scaled as they are projected.
AFMoE: `gate_proj`, the output gate from a projection of its own (H x head_dim features, split with the heads);
Step-3.5: `gate_per_head`, that projection's H features, one gate a head (each head's output scaled alike), and
`scale`, the softmax scale when it is not head_dim ** -0.5 (its query_pre_attn_scalar ** -0.5).
Laguna: `gate_activation="softplus"`, its gates softplus(g_proj(x)) rather than sigmoid.
EXAONE-MoE (and AFMoE): `use_rope=False` on its global layers (NoPE: q and k are not rotated; its windowed layers are).
Hunyuan (A13B): `qk_norm_after_rope`, its per-head q and k norms run on the rotated q and k, not before.
OLMoE: `qk_norm_span="projection"`: one RMSNorm over the whole q projection (all heads) and
one over the whole k projection (`q_proj_norm`, `k_proj_norm`; under TP each rank holds its
heads' part of the weight and the mean of squares is summed over the TP group; of the class `norm`: FlexOlmo's
`WeightFirstRMSNorm`), then q, k
and v clamped to +-`clip_qkv` when the config sets it.
Under tensor parallelism (`tp`, engine/parallel/tensor.py) a rank holds H / tp_size heads
and H_kv / tp_size key/value heads (q/k/v split by output features, o_proj by input
features): its o_proj output is a partial sum, all-reduced over the TP group before
o_proj's bias is added (once).
Shapes: B batch, T new tokens, H heads, H_kv key/value heads (this rank's), hd head_dim, rd rotary_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor import TensorParallel
from .kv_cache import KVCache, WindowKVCache
from .norm import RMSNorm
from .rope import apply_rotary

# The output gate's activation: sigmoid (every gated family's), or softplus in float32 (Laguna's)
GATE_ACTIVATIONS = {"sigmoid": torch.sigmoid, "softplus": lambda g: F.softplus(g.float()).to(g.dtype)}


class GQAttention(nn.Module):
    def __init__(self, hidden_size: int, n_heads: int, n_kv_heads: int, head_dim: int, *, qkv_bias: bool,
                 o_bias: bool, qk_norm: bool, rms_norm_eps: float, rotary_dim: int | None = None,
                 dtype: torch.dtype | None = None, tp: TensorParallel | None = None,
                 sliding_window: int | None = None, qk_norm_span: str = "head", clip_qkv: float | None = None,
                 sinks: bool = False, output_gate: bool = False, norm: type[RMSNorm] = RMSNorm,
                 rope_interleave: bool = False, qk_norm_after_rope: bool = False, use_rope: bool = True,
                 gate_proj: bool = False, gate_per_head: bool = False, gate_activation: str = "sigmoid",
                 v_head_dim: int | None = None, v_scale: float = 1.0, scale: float | None = None):
        super().__init__()
        if qk_norm_span not in ("head", "projection"):
            raise ValueError(f"qk_norm_span={qk_norm_span!r}: 'head' or 'projection'")
        if clip_qkv is not None and clip_qkv <= 0:
            raise ValueError(f"clip_qkv={clip_qkv} must be > 0")
        self.clip_qkv = clip_qkv
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be >= 1")
        self.sliding_window = sliding_window
        if n_heads % n_kv_heads:
            raise ValueError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv_heads}")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim={rotary_dim} must be even and in (0, head_dim={head_dim}]")
        self.tp = tp = tp or TensorParallel()
        full_q, full_k = n_heads * head_dim, n_kv_heads * head_dim
        n_heads, n_kv_heads = tp.split(n_heads, "num_attention_heads"), tp.split(n_kv_heads, "num_key_value_heads")
        self.n_heads, self.n_kv_heads, self.head_dim, self.rotary_dim = n_heads, n_kv_heads, head_dim, rotary_dim
        self.v_head_dim = v_head_dim = v_head_dim or head_dim
        if v_head_dim != head_dim and (output_gate or gate_proj):
            raise ValueError("an output gate needs values as wide as the heads (v_head_dim == head_dim)")
        self.v_scale = v_scale
        self.rope_interleave = rope_interleave
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.output_gate = output_gate
        q_width = n_heads * head_dim * (2 if output_gate else 1)   # a head's rows: its query, then its gate
        self.q_proj = nn.Linear(hidden_size, q_width, bias=qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden_size, n_kv_heads * head_dim, bias=qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden_size, n_kv_heads * v_head_dim, bias=qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(n_heads * v_head_dim, hidden_size, bias=o_bias, dtype=dtype)
        if output_gate and gate_proj:
            raise ValueError("output_gate (in q_proj's rows) and gate_proj (a projection of its own): one or the other")
        if gate_per_head and not gate_proj:
            raise ValueError("gate_per_head shapes the gate projection's output: it needs gate_proj")
        self.gate_per_head = gate_per_head
        if gate_activation not in GATE_ACTIVATIONS:
            raise ValueError(f"gate_activation={gate_activation!r}: one of {', '.join(GATE_ACTIVATIONS)}")
        self.gate_activation = gate_activation
        self.gate_proj = nn.Linear(hidden_size, n_heads * (1 if gate_per_head else head_dim), bias=False,
                                   dtype=dtype) if gate_proj else None
        per_head = qk_norm and qk_norm_span == "head"
        if qk_norm_after_rope and not per_head:
            raise ValueError("qk_norm_after_rope needs per-head q and k norms (qk_norm, qk_norm_span='head')")
        self.qk_norm_after_rope = qk_norm_after_rope
        self.use_rope = use_rope
        self.q_norm = norm(head_dim, rms_norm_eps, dtype) if per_head else None
        self.k_norm = norm(head_dim, rms_norm_eps, dtype) if per_head else None
        self.q_proj_norm = self.k_proj_norm = None
        if qk_norm and qk_norm_span == "projection":
            split = lambda full: dict(full_dim=full, reduce=tp.reduce) if tp.size > 1 else {}  # noqa: E731
            self.q_proj_norm = norm(n_heads * head_dim, rms_norm_eps, dtype, **split(full_q))
            self.k_proj_norm = norm(n_kv_heads * head_dim, rms_norm_eps, dtype, **split(full_k))
        # [H] this rank's heads' sink logits (TP splits them with the heads)
        self.sinks = nn.Parameter(torch.empty(n_heads, dtype=dtype), requires_grad=False) if sinks else None
        self.kv_cache: KVCache | None = None   # set by the model's setup_caches
        # Chunked local attention (Llama 4's rope layers): a query sees the keys of its own chunk of this many
        # positions only. A family sets it after construction, with `_rotate` / `_after_rotary` (models/llama4.py).
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
