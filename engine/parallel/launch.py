"""Run one function on N torch.distributed ranks and get every rank's result back.

    results = launch(2, fn, a, b)        # fn(rank, world_size, a, b) in 2 processes

Each rank is a fresh process forked by multiprocessing's fork server, which has
torch imported but never ran a kernel nor touched CUDA: as safe as `spawn` (no
inherited thread pools or CUDA context, unlike a plain fork of the caller) without
paying the torch import per rank per launch (seconds on a small machine; the
parallel tests launch many times). The server starts on the first launch and keeps
no state of the caller: each launch hands its ranks the caller's current environment
and sys.path (so a test's monkeypatched variable reaches them). `start_method="spawn"`
(also the fallback where there is no fork server) starts every rank from scratch.

Rank 0 opens the rendezvous store on a free loopback port it binds itself (port 0),
so two launches never race for a port; the others learn it from the parent. The
process group is gloo on CPU and NCCL when CUDA has a device per rank: that choice
is the only place the device matters.

Never a hang: every collective carries the process group's timeout, and the parent
watches the ranks. The first rank that fails (exception, non-zero exit, signal,
unpicklable result, or no answer within `timeout_s`) makes the parent tear every
rank down and raise `RankFailed` with that rank's number and traceback. When several
ranks fail, the earliest failure is the cause (the others usually fail because of
it: a peer's socket closed under them); they are kept in `RankFailed.others`. For a
hang, each stuck rank is asked for its stack (faulthandler on SIGUSR1) before it is
killed, so the error shows where it waited.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import random
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

# Startup (interpreter + torch import + rendezvous) is not counted in timeout_s: on a
# loaded 2-core machine it alone can take several seconds per rank.
STARTUP_TIMEOUT_S = 120.0
_HOST = "127.0.0.1"


class RankFailed(RuntimeError):
    """A rank of a `launch` failed; `rank` is the first failure, `error` its text."""

    def __init__(self, rank: int, error: str, others: dict[int, str] | None = None):
        self.rank = rank
        self.error = error
        self.others = dict(others or {})
        extra = f" (also failed: ranks {sorted(self.others)})" if self.others else ""
        super().__init__(f"rank {rank} failed{extra}:\n{error}")


def default_backend(nproc: int) -> str:
    """NCCL when every rank can have its own CUDA device, else gloo."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= nproc:
        return "nccl"
    return "gloo"


def rank_device() -> torch.device:
    """The device of this rank's tensors for the current process group's backend."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_seed(seed: int) -> None:
    """Seed every generator a rank uses (python, torch CPU and CUDA, numpy if present)."""
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        return
    np.random.seed(seed % 2**32)


# -- the rank process ----------------------------------------------------------

_collective_timeout: datetime.timedelta | None = None


def collective_timeout() -> datetime.timedelta | None:
    """The timeout this rank's launch gave its process group (None outside a launched rank):
    groups created later (groups.make_grid) use it too, instead of torch's 30-minute default."""
    return _collective_timeout


@dataclass(frozen=True)
class _Job:
    """What every rank of one launch runs, and in which process group."""

    world_size: int
    backend: str
    fn_pickle: bytes          # fn and its args, unpickled in the rank once its sys.path is the caller's
    args_pickle: bytes
    collective_timeout_s: float
    threads: int              # torch's intra-op threads (0: torch's default)
    env: dict                 # the caller's environment and import path
    path: list


def _worker(rank: int, job: _Job, port, port_ready, results, stack_file: str) -> None:
    """One rank: `port` / `port_ready` share rank 0's rendezvous port, `results` carries its reports to the parent,
    `stack_file` receives its Python stack on a native abort or a hang."""
    import faulthandler

    import torch.distributed as dist

    dump = open(stack_file, "w")
    faulthandler.enable(file=dump, all_threads=True)     # a native abort still leaves its Python stack
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    try:
        os.environ.clear()               # the caller's environment and import path of THIS launch
        os.environ.update(job.env)
        sys.path[:] = job.path
        fn, args = pickle.loads(job.fn_pickle), pickle.loads(job.args_pickle)
        if job.threads > 0:
            torch.set_num_threads(job.threads)   # N ranks on few cores: no oversubscription
        timeout = datetime.timedelta(seconds=job.collective_timeout_s)
        world_size, backend = job.world_size, job.backend
        global _collective_timeout
        _collective_timeout = timeout
        if rank == 0:
            store = dist.TCPStore(_HOST, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
            port.value = store.port
            port_ready.set()
        else:
            if not port_ready.wait(STARTUP_TIMEOUT_S):
                raise TimeoutError("rank 0 never opened the rendezvous store")
            store = dist.TCPStore(_HOST, port.value, world_size, is_master=False, timeout=timeout)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        results.put(("ready", rank, None, time.time()))
        out = fn(rank, world_size, *args)
        payload = pickle.dumps(out)          # here, so an unpicklable result is this rank's error
        results.put(("ok", rank, payload, time.time()))
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        results.put(("err", rank, traceback.format_exc(), time.time()))
        results.close()
        results.join_thread()                # the report must reach the parent before we exit
        os._exit(1)
    # Keep the store (hosted by rank 0) alive until every rank is done with fn.
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - results are already delivered; teardown noise is not an error
        pass
    results.close()
    results.join_thread()


# -- the parent ----------------------------------------------------------------

def _context(start_method: str | None):
    import multiprocessing

    if start_method is None:
        start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    return ctx


def launch(nproc: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120,
           backend: str | None = None, threads_per_rank: int | None = None,
           start_method: str | None = None) -> list[Any]:
    """Run fn(rank, world_size, *args) on `nproc` ranks; return the results in rank order.

    fn and args must be picklable (a module-level function). `timeout_s` bounds the
    run after the process group is up and is also every collective's timeout.
    Raises RankFailed if any rank fails, after tearing all of them down."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    backend = backend or default_backend(nproc)
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // nproc) if backend == "gloo" else 0
    # Pickled here, unpickled in the rank after its sys.path is set (fn's module may
    # only be importable from the caller's current path).
    job = _Job(nproc, backend, pickle.dumps(fn), pickle.dumps(args), float(timeout_s), threads_per_rank,
               dict(os.environ), list(sys.path))
    ctx = _context(start_method)
    port = ctx.Value("i", 0)
    port_ready = ctx.Event()
    results = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="loadplan-launch-")
    stack_files = [os.path.join(tmpdir, f"rank{r}.stack") for r in range(nproc)]
    procs = []
    ok = False
    try:
        for r in range(nproc):
            p = ctx.Process(target=_worker, name=f"loadplan-rank{r}", daemon=True,
                            args=(r, job, port, port_ready, results, stack_files[r]))
            p.start()
            procs.append(p)
        out = _collect(procs, results, timeout_s, stack_files)
        ok = True
        return out
    finally:
        _teardown(procs, graceful=ok)
        for f in stack_files:
            try:
                os.unlink(f)
            except OSError:
                pass
        try:
            os.rmdir(tmpdir)
        except OSError:
            pass


def _collect(procs, results, timeout_s: float, stack_files: list[str]) -> list[Any]:
    n = len(procs)
    ready: set[int] = set()
    done: dict[int, Any] = {}
    errors: dict[int, tuple[float, str]] = {}
    start_deadline = time.monotonic() + STARTUP_TIMEOUT_S
    run_deadline = None

    def handle(msg) -> None:
        nonlocal run_deadline
        kind, rank, payload, at = msg
        if kind == "ready":
            ready.add(rank)
            if len(ready) == n:
                run_deadline = time.monotonic() + timeout_s
        elif kind == "ok":
            done[rank] = pickle.loads(payload)
        else:
            errors[rank] = (at, payload)

    def drain(wait: float) -> None:
        try:
            handle(results.get(timeout=wait))
            while True:
                handle(results.get_nowait())
        except queue_mod.Empty:
            pass

    while len(done) < n:
        drain(0.05)
        if errors:
            drain(0.5)   # a peer's report of the same incident may be in flight: blame the cause
            _note_silent_deaths(procs, done, errors, stack_files)
            _raise_first(errors)
        if _note_silent_deaths(procs, done, errors, stack_files, drain):
            drain(0.5)
            _raise_first(errors)
        now = time.monotonic()
        if run_deadline is None and now > start_deadline:
            missing = sorted(set(range(n)) - ready)
            raise RankFailed(missing[0], f"did not join the process group within {STARTUP_TIMEOUT_S:g}s "
                                         f"(ranks not ready: {missing})")
        if run_deadline is not None and now > run_deadline:
            stuck = [r for r in range(n) if r not in done]
            stacks = _stacks(procs, stuck, stack_files)
            raise RankFailed(stuck[0], f"no result within timeout_s={timeout_s:g}s (ranks without a result: "
                                       f"{stuck})\n{stacks[stuck[0]]}",
                             {r: f"no result within timeout_s={timeout_s:g}s\n{stacks[r]}" for r in stuck[1:]})
    return [done[r] for r in range(n)]


def _note_silent_deaths(procs, done, errors, stack_files, drain=None) -> bool:
    """Record ranks that exited without reporting (os._exit, a signal, a native abort)."""
    found = False
    for r, p in enumerate(procs):
        if r in done or r in errors or p.is_alive():
            continue
        if drain is not None:
            drain(1.0)    # an exited rank's last message may still be in the pipe
            if r in done or r in errors:
                continue
        code = p.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        stack = _read(stack_files[r])
        errors[r] = (time.time(), f"{how} without a result" + (f"\nstack of rank {r}:\n{stack}" if stack else ""))
        found = True
    return found


# A rank that lost a peer fails with one of these; it is a consequence, not the cause.
_PEER_LOSS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed",
              "connection closed", "Connection refused")


def _raise_first(errors: dict[int, tuple[float, str]]):
    def key(r):
        at, text = errors[r]
        return (any(s in text for s in _PEER_LOSS), at)

    first = min(errors, key=key)
    raise RankFailed(first, errors[first][1], {r: e for r, (_, e) in errors.items() if r != first})


def _stacks(procs, ranks: list[int], stack_files: list[str]) -> dict[int, str]:
    """Ask the stuck ranks where they are (faulthandler on SIGUSR1) before they are killed."""
    if not hasattr(signal, "SIGUSR1"):
        return {r: "" for r in ranks}
    for r in ranks:
        if procs[r].is_alive():
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
    time.sleep(0.5)
    out = {}
    for r in ranks:
        text = _read(stack_files[r])
        out[r] = f"stack of rank {r}:\n{text}" if text else ""
    return out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _teardown(procs, graceful: bool) -> None:
    if graceful:   # every rank delivered its result and is closing its process group: a moment for it
        deadline = time.monotonic() + 1.0
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)
