"""The grouped expert MLP on CPU: y[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = slot[t, k].

Shapes: T tokens, K slots per token, D hidden, I expert intermediate, S expert
slots held here (routed + fused shared), N = rows kept (token, slot) pairs.

    gate_up [S, 2I, D]   rows [0, I) gate, [I, 2I) up (HF's layout)
    down    [S, D, I]

Slot ids >= S mean "not here" (another rank's expert) and are dropped.

Why it is shaped like this (measured on 2 cores, D=1024, I=256, 64 experts, top-8,
fp32; bench/moe.py):
- Decode (T=1) reads K experts' weights once, so it is bound by memory bandwidth:
  one matrix-vector product per kept slot, straight into preallocated rows, and
  the down projection accumulates into y with addmv (no sort, no bincount, no
  index_add).
- Otherwise rows are sorted by slot so each hit expert does ONE matmul over a
  contiguous slice (its weights are read once however many tokens chose it). The
  two projections run in two passes over the slots with the activation in
  between done once over all N rows: per expert only the two matmuls run, which
  matters when ~60 experts hold 1-3 rows each (T=16). Each pass is a Python loop
  of torch.mm into slices of one output, or with `grouped_mm=True` (or
  USE_GROUPED_MM) one call of torch's CPU grouped_mm: the same per-slot loop in
  C++, without a Python dispatch per expert (faster in bench/moe.py's fastest
  runs at T=16 and 512; off by default until the engine's tests count its
  matmuls through it).
- The routing weight scales h [N, I] before the down projection (I < D, and the
  down projection is linear), and index_add_ sums each token's rows into y.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


# torch.nn.functional.grouped_mm runs on CPU from torch 2.9; before 2.11 it needs 16-byte aligned operands,
# which memory-mapped checkpoint tensors do not guarantee.
GROUPED_MM_AVAILABLE = hasattr(F, "grouped_mm") and tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 11)
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
USE_GROUPED_MM = False          # the default of the `grouped_mm` arguments below


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> silu(gate) * up [N, I]."""
    I = gate_up.shape[-1] // 2
    h = F.silu(gate_up[:, :I])
    return h.mul_(gate_up[:, I:])


def grouped_expert_mlp(xs: torch.Tensor, counts: Sequence[int], gate_up: torch.Tensor, down: torch.Tensor,
                       row_weights: torch.Tensor | None = None, grouped_mm: bool | None = None) -> torch.Tensor:
    """xs [N, D] sorted by slot, counts[s] rows for slot s (sum(counts) == N) -> [N, D].

    Row i of the result is down_s(silu(gate_s(xs[i])) * up_s(xs[i])), times row_weights[i] if given.
    grouped_mm (default USE_GROUPED_MM): use torch's grouped_mm where it runs (CPU, float32/16, bf16)."""
    N = xs.shape[0]
    assert sum(counts) == N, f"counts sum to {sum(counts)}, xs has {N} rows"
    if (USE_GROUPED_MM if grouped_mm is None else grouped_mm) and GROUPED_MM_AVAILABLE \
            and xs.device.type == "cpu" and xs.dtype in _GROUPED_MM_DTYPES and len(counts) == gate_up.shape[0]:
        offs = torch.tensor(counts, dtype=torch.int64).cumsum_(0).to(torch.int32)
        h = silu_mul(F.grouped_mm(xs, gate_up.transpose(1, 2), offs=offs))      # [N, I]
        if row_weights is not None:
            h.mul_(row_weights.to(h.dtype)[:, None])
        return F.grouped_mm(h, down.transpose(1, 2), offs=offs)
    spans = []                                                   # (slot, start, end) of each hit slot
    start = 0
    for s, n in enumerate(counts):
        if n:
            spans.append((s, start, start + n))
            start += n
    g = xs.new_empty(N, gate_up.shape[1])
    for s, a, b in spans:
        torch.mm(xs[a:b], gate_up[s].t(), out=g[a:b])
    h = silu_mul(g)                                              # [N, I]
    if row_weights is not None:
        h.mul_(row_weights.to(h.dtype)[:, None])
    out = xs.new_empty(N, down.shape[1])
    for s, a, b in spans:
        torch.mm(h[a:b], down[s].t(), out=out[a:b])
    return out


def _decode(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor) -> torch.Tensor:
    """One token: its K slots are (normally) K distinct experts, so no grouping is needed (a repeated slot
    is computed twice)."""
    S = gate_up.shape[0]
    ids = slots.reshape(-1).tolist()
    keep = [k for k, s in enumerate(ids) if s < S]
    y = x.new_zeros(x.shape[1])
    if not keep:
        return y[None]
    w = weights.reshape(-1)
    if len(keep) < len(ids):
        w = w[keep]
    g = x.new_empty(len(keep), gate_up.shape[1])
    x0 = x[0]
    for j, k in enumerate(keep):
        torch.mv(gate_up[ids[k]], x0, out=g[j])
    h = silu_mul(g).mul_(w.to(x.dtype)[:, None])                # [n, I]
    for j, k in enumerate(keep):
        y.addmv_(down[ids[k]], h[j])
    return y[None]


def sort_by_slot(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, list[int]]:
    """slots [T, K] -> (order [N]: flat (t*K + k) indices of kept rows grouped by slot, counts per slot [S])."""
    flat = slots.reshape(-1)
    counts = torch.bincount(flat, minlength=num_slots + 1).tolist()[:num_slots]
    order = torch.argsort(flat, stable=True)                     # dropped ids (>= S) sort last
    return order[: sum(counts)], counts


def fused_experts(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, grouped_mm: bool | None = None) -> torch.Tensor:
    """x [T, D], slots [T, K] local slot ids (>= S dropped), weights [T, K] -> y [T, D] in x's dtype."""
    T, K = slots.shape
    if T == 1:
        return _decode(x, slots, weights, gate_up, down)
    order, counts = sort_by_slot(slots, gate_up.shape[0])
    token = torch.div(order, K, rounding_mode="floor")           # [N] source token of each row
    xs = x.index_select(0, token)                                # [N, D] contiguous per slot
    w = weights.reshape(-1).index_select(0, order)
    out = grouped_expert_mlp(xs, counts, gate_up, down, row_weights=w, grouped_mm=grouped_mm)
    return x.new_zeros(T, x.shape[1]).index_add_(0, token, out)
