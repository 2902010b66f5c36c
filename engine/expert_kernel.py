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
  matters when ~60 experts hold 1-3 rows each (T=16). Each pass is a loop of
  torch.mm into slices of one output.
- With expert_parallel (T > 1), whole experts go to each core instead of each
  matmul being split over the cores: one synchronisation per layer instead of two
  per expert. torch's CPU grouped_mm (the same loop in C++) was measured too: no
  better than the Python loop, and behind expert_parallel.
- The routing weight scales h [N, I] before the down projection (I < D, and the
  down projection is linear), and index_add_ sums each token's rows into y.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Sequence

import torch
import torch.nn.functional as F


# Default of the `expert_parallel` arguments below: whole experts per core (bench/moe.py measures both).
# A test that counts matmuls with a thread-local TorchDispatchMode turns it off for itself.
EXPERT_PARALLEL = True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> silu(gate) * up [N, I]."""
    I = gate_up.shape[-1] // 2
    h = F.silu(gate_up[:, :I])
    return h.mul_(gate_up[:, I:])


def grouped_expert_mlp(xs: torch.Tensor, counts: Sequence[int], gate_up: torch.Tensor, down: torch.Tensor,
                       row_weights: torch.Tensor | None = None, expert_parallel: bool | None = None) -> torch.Tensor:
    """xs [N, D] sorted by slot, counts[s] rows for slot s (sum(counts) == N) -> [N, D].

    Row i of the result is down_s(silu(gate_s(xs[i])) * up_s(xs[i])), times row_weights[i] if given.
    expert_parallel (default EXPERT_PARALLEL): whole slots per thread, see _expert_parallel."""
    N = xs.shape[0]
    assert sum(counts) == N, f"counts sum to {sum(counts)}, xs has {N} rows"
    spans = []                                                   # (slot, start, end) of each hit slot
    start = 0
    for s, n in enumerate(counts):
        if n:
            spans.append((s, start, start + n))
            start += n
    out = xs.new_empty(N, down.shape[1])
    if not spans:
        return out
    threads = torch.get_num_threads()
    if (EXPERT_PARALLEL if expert_parallel is None else expert_parallel) and threads > 1 and len(spans) > 1:
        _expert_parallel(spans, threads, xs, gate_up, down, row_weights, out)
    else:
        _slot_range(spans, xs, gate_up, down, row_weights, out)
    return out


def _slot_range(spans, xs, gate_up, down, row_weights, out) -> None:
    """Both projections for the rows of `spans` (consecutive), written into `out`."""
    a0, b0 = spans[0][1], spans[-1][2]
    g = xs.new_empty(b0 - a0, gate_up.shape[1])
    for s, a, b in spans:
        torch.mm(xs[a:b], gate_up[s].t(), out=g[a - a0:b - a0])
    h = silu_mul(g)                                              # [rows, I]
    if row_weights is not None:
        h.mul_(row_weights[a0:b0].to(h.dtype)[:, None])
    for s, a, b in spans:
        torch.mm(h[a - a0:b - a0], down[s].t(), out=out[a:b])


def _in_modes(modes, *args) -> None:
    grad, inference = modes
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        _slot_range(*args)


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def _expert_parallel(spans, threads, xs, gate_up, down, row_weights, out) -> None:
    """Slots split over `threads` Python threads, each running its matmuls on one core.

    One 2-thread matmul per expert synchronises its threads ~2x per expert; whole experts per thread
    synchronise once per layer, which keeps small matmuls efficient and does not collapse when
    the cores are shared. The BLAS runs single-threaded meanwhile (torch.set_num_threads is
    process-wide: restored on exit)."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < threads - 1:
            _POOL, _POOL_SIZE = concurrent.futures.ThreadPoolExecutor(threads - 1, "expert-kernel"), threads - 1
    total = spans[-1][2] - spans[0][1]
    chunks, cur, done = [], [], 0                                 # consecutive spans, ~equal rows each
    for span in spans:
        cur.append(span)
        done += span[2] - span[1]
        if done * threads >= total * (len(chunks) + 1) and len(chunks) < threads - 1:
            chunks.append(cur)
            cur = []
    if cur:
        chunks.append(cur)
    # grad and inference mode are thread-local: the workers take this thread's
    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    torch.set_num_threads(1)
    try:
        futures = [_POOL.submit(_in_modes, modes, c, xs, gate_up, down, row_weights, out) for c in chunks[1:]]
        try:
            _slot_range(chunks[0], xs, gate_up, down, row_weights, out)
        finally:
            concurrent.futures.wait(futures)                      # never leave a worker writing into `out`
        for f in futures:
            f.result()
    finally:
        torch.set_num_threads(threads)


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
                  down: torch.Tensor, expert_parallel: bool | None = None) -> torch.Tensor:
    """x [T, D], slots [T, K] local slot ids (>= S dropped), weights [T, K] -> y [T, D] in x's dtype."""
    T, K = slots.shape
    if T == 1:
        return _decode(x, slots, weights, gate_up, down)
    order, counts = sort_by_slot(slots, gate_up.shape[0])
    token = torch.div(order, K, rounding_mode="floor")           # [N] source token of each row
    xs = x.index_select(0, token)                                # [N, D] contiguous per slot
    w = weights.reshape(-1).index_select(0, order)
    out = grouped_expert_mlp(xs, counts, gate_up, down, row_weights=w, expert_parallel=expert_parallel)
    return x.new_zeros(T, x.shape[1]).index_add_(0, token, out)
