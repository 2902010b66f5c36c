"""Which implementation computes a layer's routed experts: measured on this machine, not assumed.

The implementations (engine/expert_kernel.py's `fused_experts(..., impl=NAME)`), all the same arithmetic:
- "kernel": the compiled kernel (engine/expert_native.py), float32 and bfloat16 (weights kept in bfloat16, sums
  in float32);
- "grouped_mm": torch.nn.functional.grouped_mm over the rows sorted by expert (what transformers'
  `experts_implementation="grouped_mm"` runs), where this torch has it for the dtype;
- "per_expert": one matmul pair per hit expert (torch.mm / torch.mv), whole experts per core.

Which is fastest depends on the machine (its vector units, cores, memory) and on the shape: a kernel
tuned on one CPU was slower than both torch paths at decode on another (issue 34). So at the first call of
each shape class (dtype, T bucket, K, slots, D, I, threads), the candidates that apply are timed on the
layer's own weights and inputs, interleaved, and the fastest (by its fastest call: the least disturbed on a
shared machine) is kept, logged once, and cached in `expert_choice_<cpu key>.json` next to the compiled
kernel (the key: the CPU's feature flags and torch's version, expert_native.cpu_key(), and the kernel's source,
expert_native.source_key()), so later processes on this machine do not measure again. `LOADPLAN_EXPERTS_IMPL=NAME`
forces one (where it cannot compute the layer, e.g. the kernel on float16 weights, the layer takes "per_expert"
and says so once).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable

import torch
import torch.nn.functional as F

from . import expert_native

log = logging.getLogger(__name__)

IMPLS = ("kernel", "grouped_mm", "per_expert")
ENV = "LOADPLAN_EXPERTS_IMPL"
# Time spent measuring one candidate of one shape class, at most (and at least MIN_REPS calls). Up to MAX_REPS
# calls within it: on a shared machine the fastest of 30 decode calls (~1-2 ms each) still picked a slower
# implementation (bench/moe.py, issue 53: per_expert over the kernel at T=1), so fast shapes get more calls.
BUDGET_S = 0.25
MIN_REPS, MAX_REPS = 3, 120

_LOCK = threading.Lock()
_CHOICES: dict[str, str] | None = None           # shape class -> implementation, this machine's
_TIMES: dict[str, dict[str, float]] = {}         # shape class -> {impl: fastest ms}, measured in this process
_SAID: set[str] = set()                          # log lines already written


def forced() -> str | None:
    """The implementation LOADPLAN_EXPERTS_IMPL names, None if unset; a ValueError naming the variable if it is
    not one of IMPLS."""
    v = os.environ.get(ENV, "").strip()
    if not v:
        return None
    if v not in IMPLS:
        raise ValueError(f"{ENV}={v!r}: expected one of {', '.join(IMPLS)}")
    return v


def t_bucket(T: int) -> int:
    """Token counts measured alike: 1, then the next power of 4 (4, 16, 64, 256, 1024, ...)."""
    b = 1
    while b < T:
        b *= 4
    return b


def shape_class(x: torch.Tensor, slots: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> str:
    T, K = slots.shape
    return (f"{str(x.dtype).removeprefix('torch.')}/T{t_bucket(T)}/K{K}/S{gate_up.shape[0]}/D{down.shape[1]}"
            f"/I{down.shape[2]}/threads{torch.get_num_threads()}")


def grouped_mm_applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    # grouped_mm wants every operand's row stride a multiple of 16 bytes ("strides should be multiple of
    # 16 bytes"): the hidden size D and the intermediate size I (a tensor-parallel shard's may be odd).
    aligned = all(n * x.element_size() % 16 == 0 for n in (x.shape[1], down.shape[-1]))
    return (hasattr(F, "grouped_mm") and x.dtype == gate_up.dtype and x.device.type == "cpu" and aligned
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16))     # what grouped_mm computes in


def applies(impl: str, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    if impl == "kernel":
        return expert_native.applies(x, gate_up, down)
    if impl == "grouped_mm":
        return grouped_mm_applies(x, gate_up, down)
    return True


def _say(key: str, msg: str, *args) -> None:
    if key not in _SAID:
        _SAID.add(key)
        log.info(msg, *args)


def _path():
    # per CPU and torch (cpu_key) and per version of the kernel's source: a choice measured before the kernel
    # computed a dtype (bfloat16) or changed speed is not reused
    return expert_native.cache_dir() / f"expert_choice_{expert_native.cpu_key()}_{expert_native.source_key()}.json"


def _load() -> dict[str, str]:
    global _CHOICES
    if _CHOICES is None:
        try:
            data = json.loads(_path().read_text())
            _CHOICES = {k: v for k, v in data.items() if isinstance(v, str) and v in IMPLS}
        except (OSError, ValueError):
            _CHOICES = {}
    return _CHOICES


def _store(key: str, impl: str) -> None:
    choices = _load()
    choices[key] = impl
    try:
        p = _path()
        try:                                                     # another process's choices since we read
            merged = {**json.loads(p.read_text()), **choices}
        except (OSError, ValueError):
            merged = dict(choices)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
        os.replace(tmp, p)                                       # atomic: concurrent writers race harmlessly
    except OSError as e:
        _say("store", "experts: measured choices not cached (%s)", e)


def measure(candidates: list[str], run: Callable[[str, int], object]) -> dict[str, float]:
    """Fastest call in ms of each candidate, calls interleaved (a burst of load hits all alike); run(impl, n) is
    the n-th call."""
    best = {c: float("inf") for c in candidates}
    spent = {c: 0.0 for c in candidates}
    n = 0
    for c in candidates:                                         # warm-up: first calls build/allocate
        run(c, n)
        n += 1
    for rep in range(MAX_REPS):
        for c in candidates:
            t0 = time.perf_counter()
            run(c, n)
            n += 1
            dt = time.perf_counter() - t0
            best[c], spent[c] = min(best[c], dt), spent[c] + dt
        if rep + 1 >= MIN_REPS and max(spent.values()) > BUDGET_S:
            break
    return {c: t * 1e3 for c, t in best.items()}


def choose(x: torch.Tensor, slots: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
           run: Callable[[str, int], object]) -> str:
    """The implementation for this call: forced by LOADPLAN_EXPERTS_IMPL, else the one measured fastest for its
    shape class (measured now, if this machine has not measured the class yet, with `run(impl, n)`: the n-th
    timed call, which computes this call's shapes with that implementation, on other experts for each n)."""
    want = forced()
    if want is not None:
        if applies(want, x, gate_up, down):
            return want
        _say(f"forced-{want}-{x.dtype}", "experts: %s=%s cannot compute %s experts %s; they run per_expert", ENV, want,
             x.dtype, "(" + expert_native.unavailable_reason() + ")" if want == "kernel" and
             expert_native.unavailable_reason() else "")
        return "per_expert"
    key = shape_class(x, slots, gate_up, down)
    with _LOCK:
        impl = _load().get(key)
        if impl is not None and applies(impl, x, gate_up, down):
            _say(key, "experts %s: %s (measured before on this machine)", key, impl)
            return impl
        candidates = [c for c in IMPLS if applies(c, x, gate_up, down)]
        if "kernel" not in candidates and expert_native.unavailable_reason():
            _say("no-kernel", "experts: no compiled kernel (%s): choosing among %s", expert_native.unavailable_reason(),
                 ", ".join(candidates))
        with torch.inference_mode():
            times = measure(candidates, run) if len(candidates) > 1 else {candidates[0]: 0.0}
        impl = min(times, key=times.get)
        _TIMES[key] = times
        _store(key, impl)
        _say(key, "experts %s: %s (measured, fastest call ms: %s)", key, impl,
             ", ".join(f"{c} {t:.3f}" for c, t in times.items()))
        return impl


def chosen() -> dict[str, str]:
    """Shape class -> implementation, as known to this process (measured or read from the cache)."""
    with _LOCK:
        return dict(_load())


def measured() -> dict[str, dict[str, float]]:
    """Shape class -> {impl: fastest ms} for the classes this process measured."""
    with _LOCK:
        return {k: dict(v) for k, v in _TIMES.items()}


def forget(read_cache: bool = True) -> None:
    """Drop this process's choices (not the cache file): the next call reads the file again, or with
    read_cache=False measures every shape class anew (and updates the file)."""
    global _CHOICES
    with _LOCK:
        _CHOICES = None if read_cache else {}
        _TIMES.clear()
        _SAID.clear()
