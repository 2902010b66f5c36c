"""The grouped expert MLP on CPU: y[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = slot[t, k].

Shapes: T tokens, K slots per token, D hidden, I expert intermediate, S expert
slots held here (routed + fused shared), N = rows kept (token, slot) pairs.

    gate_up [S, 2I, D]   rows [0, I) gate, [I, 2I) up (HF's layout)
    down    [S, D, I]

Slot ids >= S mean "not here" (another rank's expert) and are dropped.

Why it is shaped like this (measured on 2 cores, D=1024, I=256, 64 experts, top-8,
fp32; bench/moe.py):
Which implementation runs (impl="kernel": the compiled kernel; "grouped_mm": torch.nn.functional.grouped_mm;
"per_expert": the torch path below) is measured per shape class on the machine at hand
(engine/expert_choice.py): the figures below are from where each was tuned.

- impl="kernel": every expert goes to engine/expert_native.py when it applies (float32 or bfloat16 alike,
  contiguous, sizes multiples of 16, a compiler, no autograd; bfloat16 weights stay bfloat16, the kernel's rows are
  float32, summed per token in float32 and rounded once to x's dtype): one C++ call per layer that hands
  the experts (split at 96 rows) to torch's OpenMP threads one at a time (dynamic: a
  core taken by another process does not hold up the layer), fuses silu(gate) * up *
  weight, and for T > 1 reads each row straight from x by token and writes it to its
  (token, k) row of [T*K, D], summed over k (`_native`: no gathered copy of x, no
  index_add). Why, per row count m of an expert:
  - m <= 4 (T=1: 8 experts, 1 row each; T=16: ~56 experts, 1-3 rows each): a handful
    of matrix-vector products over 3 MB of weights from memory. Through torch.mm /
    torch.mv they cost ~480 us per expert and core at m~2 where streaming the weights
    alone takes ~260 us: the BLAS (MKL; ~20 GFLOP/s per core at m=2 even from the
    cache) packs the weight for a small GEMM and computes at roughly the cache's speed,
    so the memory reads and the arithmetic do not overlap (single core, 64 experts
    from memory: m=1 18 ms, m=2 23 ms, m=4 27 ms; the kernel's dot products, which
    stream each weight row once with a prefetch ahead: 14-16 ms for any m <= 4).
    Bench medians before -> after that kernel: T=1 2.75 -> 2.12 ms (roofline 1.86);
    T=16 17.5 -> 9.7 ms (roofline 11.9, so 0.81x: two cores streaming with prefetch
    read faster than the probe's one matrix-vector product).
  - m > 4 (T=512: ~64 rows per expert): compute bound, but per expert the BLAS packs
    the 2 MB weight for only m rows and cannot prefetch the next expert, so ~0.4 ms of
    each expert's ~1.55 ms per core waited on memory (69 GFLOP/s per core at m=64 from
    memory). The kernel's transposed tiles (the expert's rows transposed once, one
    weight at a time broadcast against 48 rows in registers, each weight read once
    from memory with the next rows prefetched) reach 98-104 GFLOP/s per core at
    m >= 64, above MKL's dense matmul on one core (91-95): single core, 64 experts
    from memory, m=64 65.7 vs 93.2 ms, m=17 26.6 vs 44.0, m=512 494 vs 571. At T=512
    the layer's experts went 48 -> 37 ms (2 cores, fused_experts alone; router and
    top-k are ~1.1 ms more). bench/moe.py --tokens 512, alternating runs on the shared
    machine: engine/roofline 1.36, 1.56, 1.66 before (engine 58-64 ms) -> 1.05, 0.98,
    1.18 after (engine ~40 ms; 0.98 in a run where the load slowed the dense probe as
    much), 1.10-1.12 in other runs; from each probe's fastest call, 1.53-1.58 -> 1.10-1.15.
  The tiles need AVX-512; a build without it takes only experts with <= 2 rows
  (expert_native.max_rows()) and leaves the others to the torch path below, which also
  serves other dtypes, odd sizes, autograd, and when no compiler can build the kernel.
- The torch path: rows are sorted by slot so each hit expert does ONE matmul over a
  contiguous slice (its weights are read once however many tokens chose it). The two
  projections run in two passes over the slots with the activation in between done
  once over all their rows. At T=512 it measured 1.42-1.51x the dense-matmul roofline
  on the loaded machine (1.95x on a quiet one). oneDNN's matmul (AVX-512) was ~2%
  faster end to end: not worth a private op.
- Torch path with expert_parallel (T > 1): whole experts go to each core instead of each
  matmul being split over the cores: one synchronisation per layer instead of two
  per expert. torch's CPU grouped_mm (the same loop in C++) was measured too: no
  better than the Python loop, and behind expert_parallel.
- The routing weight scales h [N, I] before the down projection (I < D, and the
  down projection is linear), and index_add_ sums each token's rows into y.
- Decode (T=1) without the compiled kernel: one matrix-vector product per kept
  slot, the down projection accumulating into y with addmv (no sort, no index_add).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Sequence

import torch
import torch.nn.functional as F

from . import expert_choice, expert_native


# Default of the `expert_parallel` arguments below: whole experts per core (bench/moe.py measures both).
# A test that counts matmuls with a thread-local TorchDispatchMode turns it off for itself.
EXPERT_PARALLEL = True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> silu(gate) * up [N, I]."""
    I = gate_up.shape[-1] // 2
    h = F.silu(gate_up[:, :I])
    return h.mul_(gate_up[:, I:])


def grouped_expert_mlp(xs: torch.Tensor, counts: Sequence[int], gate_up: torch.Tensor, down: torch.Tensor,
                       row_weights: torch.Tensor | None = None, expert_parallel: bool | None = None,
                       native: bool = True) -> torch.Tensor:
    """xs [N, D] sorted by slot, counts[s] rows for slot s (sum(counts) == N) -> [N, D].

    Row i of the result is down_s(silu(gate_s(xs[i])) * up_s(xs[i])), times row_weights[i] if given.
    expert_parallel (default EXPERT_PARALLEL): whole slots per thread, see _expert_parallel. native: the compiled
    kernel takes the slots it computes well where it applies."""
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
    if native and expert_native.applies(xs, gate_up, down):
        cap = expert_native.max_rows()
        mine = [(s, a, a, b - a) for s, a, b in spans if cap is None or b - a <= cap]
        if mine:
            w = None if row_weights is None else row_weights.to(torch.float32).contiguous()
            if out.dtype == torch.float32:
                expert_native.run_spans(xs.contiguous(), gate_up, down, w, out, mine)
            else:                                                # the kernel sums in float32: rounded here
                out32 = torch.empty(N, down.shape[1], dtype=torch.float32)
                expert_native.run_spans(xs.contiguous(), gate_up, down, w, out32, mine)
                for _, a, _, m in mine:
                    out[a:a + m] = out32[a:a + m]
            spans = [span for span in spans if cap is not None and span[2] - span[1] > cap]
            if not spans:
                return out
    threads = torch.get_num_threads()
    if (EXPERT_PARALLEL if expert_parallel is None else expert_parallel) and threads > 1 and len(spans) > 1:
        _expert_parallel(spans, threads, xs, gate_up, down, row_weights, out)
    else:
        _slot_range(spans, xs, gate_up, down, row_weights, out)
    return out


def _slot_range(spans, xs, gate_up, down, row_weights, out) -> None:
    """Both projections for the rows of `spans` (ascending, consecutive where the compiled kernel took none
    in between), written into `out`."""
    a0, b0 = spans[0][1], spans[-1][2]
    rows = sum(b - a for _, a, b in spans)
    if rows == b0 - a0:                                          # consecutive: g's rows are xs' rows - a0
        at = [a - a0 for _, a, _ in spans]
    else:
        at = [0]
        for _, a, b in spans[:-1]:
            at.append(at[-1] + b - a)
    g = xs.new_empty(rows, gate_up.shape[1])
    for (s, a, b), i in zip(spans, at):
        torch.mm(xs[a:b], gate_up[s].t(), out=g[i:i + b - a])
    h = silu_mul(g)                                              # [rows, I]
    if row_weights is not None:
        w = row_weights[a0:b0] if rows == b0 - a0 else torch.cat([row_weights[a:b] for _, a, b in spans])
        h.mul_(w.to(h.dtype)[:, None])
    for (s, a, b), i in zip(spans, at):
        torch.mm(h[i:i + b - a], down[s].t(), out=out[a:b])


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
    total = sum(b - a for _, a, b in spans)
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
            down: torch.Tensor, native: bool) -> torch.Tensor:
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
    if native:
        # [n, D] one float32 row per kept slot, summed below (in float32, then rounded to x's dtype)
        rows = torch.empty(len(keep), x.shape[1], dtype=torch.float32)
        expert_native.run_spans(x.contiguous(), gate_up, down, w.to(torch.float32).contiguous(), rows,
                                [(ids[k], 0, j, 1) for j, k in enumerate(keep)])
        return rows.sum(0, keepdim=True).to(x.dtype)
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


class ClampedSwiGLU:
    """gpt-oss's expert activation on [N, 2I] rows (gate [0, I), up [I, 2I)) -> [N, I]: the gate clamped
    above and the up projection both sides at `limit`, then (up + 1) * gate * sigmoid(alpha * gate)
    (transformers' GptOssExperts._apply_gate, on the de-interleaved halves)."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        I = gate_up.shape[-1] // 2
        gate = gate_up[:, :I].clamp(max=self.limit)
        up = gate_up[:, I:].clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def __repr__(self) -> str:
        return f"ClampedSwiGLU(alpha={self.alpha}, limit={self.limit})"


def general_experts(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, *, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, act=silu_mul, weight_inputs: bool = False) -> torch.Tensor:
    """`fused_experts` for the experts its fast paths do not take, in plain torch: with biases and any
    activation (gpt-oss), or with the routing weight scaling each expert's INPUT (Llama 4):
    y[t] = sum_k w[t, k] * (down_e(act(gate_up_e(x[t]) + gate_up_bias[e])) + down_bias[e]), or with
    `weight_inputs` y[t] = sum_k down_e(act(gate_up_e(w[t, k] * x[t]))) (the experts are not linear, so
    the two differ).

    gate_up_bias [S, 2I], down_bias [S, D]; None: none (down_bias None on a TP rank other than the first:
    the bias is added once over the TP group, by the first rank). The routing weight multiplies the
    down projection's bias too, so it scales the rows after the down projection, not before."""
    T, K = slots.shape
    order, counts = sort_by_slot(slots, gate_up.shape[0])
    token = torch.div(order, K, rounding_mode="floor")           # [N] source token of each row
    xs = x.index_select(0, token)                                # [N, D] grouped by slot
    w = weights.reshape(-1).index_select(0, order).to(x.dtype)   # [N]
    if weight_inputs:
        xs = xs * w[:, None]
    rows = x.new_empty(xs.shape[0], down.shape[1])               # [N, D]
    start = 0
    for s, n in enumerate(counts):
        if not n:
            continue
        end = start + n
        g = xs[start:end] @ gate_up[s].t()                       # [n, 2I]
        h = act(g if gate_up_bias is None else g + gate_up_bias[s])                 # [n, I]
        if down_bias is None:
            torch.mm(h, down[s].t(), out=rows[start:end])
        else:
            torch.addmm(down_bias[s], h, down[s].t(), out=rows[start:end])
        start = end
    if not weight_inputs:
        rows.mul_(w[:, None])
    return x.new_zeros(T, x.shape[1]).index_add_(0, token, rows)


def fused_experts(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, expert_parallel: bool | None = None, impl: str | None = None) -> torch.Tensor:
    """x [T, D], slots [T, K] local slot ids (>= S dropped), weights [T, K] -> y [T, D] in x's dtype.

    impl: one of expert_choice.IMPLS ("kernel", "grouped_mm", "per_expert"); None: LOADPLAN_EXPERTS_IMPL, else
    the implementation measured fastest on this machine for this shape class (engine/expert_choice.py)."""
    if impl is None:
        S = gate_up.shape[0]

        def run(name: str, rep: int):       # each timed call reads other experts: weights from memory, as in a forward
            moved = torch.where(slots < S, (slots + rep * slots.shape[1]) % S, slots)
            return _run(name, x, moved, weights, gate_up, down, expert_parallel)
        impl = expert_choice.choose(x, slots, gate_up, down, run)
    elif impl not in expert_choice.IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {', '.join(expert_choice.IMPLS)}")
    return _run(impl, x, slots, weights, gate_up, down, expert_parallel)


def _run(impl, x, slots, weights, gate_up, down, expert_parallel) -> torch.Tensor:
    native = impl == "kernel" and expert_native.applies(x, gate_up, down)
    if impl == "grouped_mm" and expert_choice.grouped_mm_applies(x, gate_up, down):
        return _grouped_mm(x, slots, weights, gate_up, down)
    T, K = slots.shape
    if T == 1:
        return _decode(x, slots, weights, gate_up, down, native)
    order, counts = sort_by_slot(slots, gate_up.shape[0])
    token = torch.div(order, K, rounding_mode="floor")           # [N] source token of each row
    if native and expert_native.max_rows() is None:
        return _native(x, order, token, counts, weights, gate_up, down)
    xs = x.index_select(0, token)                                # [N, D] contiguous per slot
    w = weights.reshape(-1).index_select(0, order)
    out = grouped_expert_mlp(xs, counts, gate_up, down, row_weights=w, expert_parallel=expert_parallel,
                             native=native)
    return x.new_zeros(T, x.shape[1]).index_add_(0, token, out)


def _grouped_mm(x, slots, weights, gate_up, down) -> torch.Tensor:
    """torch.nn.functional.grouped_mm over the kept rows sorted by slot (transformers' grouped_mm experts):
    one grouped call per projection, offs[s] = the end of slot s's rows."""
    T, K = slots.shape
    S = gate_up.shape[0]
    order, counts = sort_by_slot(slots, S)
    if not order.numel():
        return x.new_zeros(T, x.shape[1])
    token = torch.div(order, K, rounding_mode="floor")
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    g = F.grouped_mm(x.index_select(0, token), gate_up.transpose(1, 2), offs=offs)         # [N, 2I]
    h = silu_mul(g).mul_(weights.reshape(-1).index_select(0, order).to(g.dtype)[:, None])  # [N, I]
    rows = F.grouped_mm(h, down.transpose(1, 2), offs=offs)                                # [N, D]
    if order.numel() == T * K:
        return rows.new_empty(T * K, rows.shape[1]).index_copy_(0, order, rows).view(T, K, -1).sum(1)
    return x.new_zeros(T, x.shape[1]).index_add_(0, token, rows)


def _native(x, order, token, counts, weights, gate_up, down) -> torch.Tensor:
    """fused_experts in one call of the compiled kernel, which reads each row's token from x itself (no
    gathered copy). Every slot kept: it writes row (t, k) of [T * K, D], summed over k here; some dropped
    (another rank's experts): it writes the N kept rows in slot order, index_add_ sums them."""
    T, K = weights.shape
    spans, N = [], 0                                              # (slot, first position, first position, rows)
    for s, n in enumerate(counts):
        if n:
            spans.append((s, N, N, n))
            N += n
    w = weights.reshape(-1).to(torch.float32)
    f32 = torch.float32                                           # the kernel's rows, summed in float32
    if N == T * K:
        rows = torch.empty(T * K, x.shape[1], dtype=f32)
        expert_native.run_spans(x.contiguous(), gate_up, down, w.contiguous(), rows, spans, x_rows=token,
                                out_rows=order)
        return rows.view(T, K, -1).sum(1).to(x.dtype)            # [T, D]
    rows = torch.empty(N, x.shape[1], dtype=f32)
    expert_native.run_spans(x.contiguous(), gate_up, down, w.index_select(0, order), rows, spans, x_rows=token)
    return torch.zeros(T, x.shape[1], dtype=f32).index_add_(0, token, rows).to(x.dtype)
