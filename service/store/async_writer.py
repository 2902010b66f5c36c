"""`AsyncPlanWriter`: a store's `save_plan` for the coroutines of the server's event loop.

The plans saved at the same time are group-committed on the loop
(`AsyncGroupCommit`): a resolve awaits its batch and holds no thread. How a batch
is written is the store's (`SqlPlanStore._save_batch` semantics: one outcome
per plan, DEFER for a second plan of the same request id):
- `ThreadedPlanWriter` runs `store._save_batch` for the whole batch on one
  worker thread: one thread hand-off per batch, not per plan (SQLite, whose
  driver blocks);
- `PgAsyncWriter` (service/store/pg_async_writer.py) writes PostgreSQL batches
  from the loop itself.
A caller waits at most the store's `wait_timeout_s` (then UNAVAILABLE: retry with
the same request id, which replays a plan that did commit).

`save_made(make, answer)` is `save(make())` whose plan is made, and whose caller's answer is
derived from what was saved, by the batch's writer, the answers while the database commits
(`_answer_early`). The server saves every resolve so. The plan of a request of a shape decided
before is cheap to make (service/transport/request_shapes.py) and is made by the writer too, so
that a batch's plans are made, written and answered in one pass, not each between two other
calls' gRPC work on the loop (1.1x the resolves per second at 64 in flight, measured with
bench/registry.py on PostgreSQL against making them in each call's handler).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from ...plan import LoadPlan
from ..errors import Unavailable
from ..registry import NewPlan
from .async_group_commit import AsyncGroupCommit
from .group_commit import GroupCommitTimeout, checked_outcomes

if TYPE_CHECKING:
    from .repository import SqlPlanStore

T = TypeVar("T")

# Under load a batch waits up to FILL_WAIT_S while plans keep arriving (`AsyncGroupCommit`: it
# stops at the first FILL_STEP_S in which none arrived): a batch's cost is mostly per batch.
# Measured on 2 cores at 64 resolves in flight: a 2-4 ms fill in 0.5 ms steps gave PostgreSQL
# 0.57-0.63x echo instead of 0.32-0.47x (SQLite 0.39-0.47x instead of 0.31-0.34x), 8 ms less;
# since plans of known shapes are made by the writer (`save_made`), 6 ms in 1 ms steps gives
# 1.08x the resolves per second of 3 ms in 0.5 ms steps (a step of 0.5 ms often ends the fill
# between two arrivals), and 0.96x at 8 in flight, where every batch waits one step in vain
# (2 ms steps: 1.07x at 64 but 0.87x at 8; 20 ms in 4 ms steps less at 64). A lone caller never
# waits.
FILL_WAIT_S = 0.006
FILL_STEP_S = 0.001
# With calls accepted ahead (service/accept_ahead.py) they reach the writer as fast as clients send
# them, and a 3 ms fill (the default then) gathers every call in flight into one batch: the clients
# all wait on it while nothing else arrives (64 in flight on 2 cores: one batch of 64 plans every
# ~11 ms). 1 ms lets a batch be written while the next one fills: 1.2x the resolves per second on
# PostgreSQL, measured with bench/registry.py --accept-ahead 4 (a deployment each and ranks of 8
# alike; 0 and 0.5 ms measured alike). Without accepting ahead, 1 ms gave 0.86x (batches too small).
FILL_WAIT_AHEAD_S = 0.001
FILL_STEP_AHEAD_S = 0.0005


class _Made:
    """A plan for the batch's writer to make (`AsyncPlanWriter.save_made`), and its caller's answer."""

    __slots__ = ("make", "answer")

    def __init__(self, make: Callable[[], NewPlan], answer: Callable[[NewPlan, LoadPlan], Any]):
        self.make = make
        self.answer = answer


def _answer_early(items: Sequence[NewPlan | _Made], at: list[int], news: list[NewPlan],
                  early: dict[int, Any]) -> None:
    """The answers of a batch's made plans for the outcome nearly every plan gets (saved as made),
    into `early` by position: run on the loop once the batch's write first waits, so they are
    derived while the database works, not after its commit on the callers' latency (0.1-0.24 ms
    off a sequential resolve's p50, measured with bench/registry.py on PostgreSQL: code run between
    idle waits runs several times slower than warm). One that fails is derived
    again after the write, which reports its error; one whose plan was not saved as made (a
    stored one replayed) is derived again from what was."""
    for i, new in zip(at, news):
        made = items[i]
        if made.__class__ is _Made:
            try:
                early[i] = made.answer(new, new.plan)
            except Exception:  # noqa: BLE001 - derived again after the write
                pass


class AsyncPlanWriter:
    """The group commit and its bounds; a subclass writes a batch (`_write`, the `write_batch` of
    `AsyncGroupCommit`) and releases what it holds (`_release`)."""

    def __init__(self, store: "SqlPlanStore", executor: Executor | None = None, *, max_leaders: int,
                 max_batch: int, fill_wait_s: float = FILL_WAIT_S):
        self.store = store
        self._executor = executor
        self.group: AsyncGroupCommit[NewPlan | _Made] = AsyncGroupCommit(
            self._write_batch, max_batch=max_batch, max_leaders=max_leaders, timeout=store.wait_timeout_s,
            fill_wait_s=fill_wait_s, fill_step_s=FILL_STEP_S)
        self._closed = False
        # Called as on_commit(seconds, n_plans) after each batch is written (service/metrics.py).
        self.on_commit: Callable[[float, int], None] | None = None

    def accepting_ahead(self) -> None:
        """The server accepts calls ahead (service/accept_ahead.py): plans arrive as fast as clients
        send them, so a batch fills for `FILL_WAIT_AHEAD_S` at most (in steps of `FILL_STEP_AHEAD_S`)."""
        self.group.fill_wait_s = min(self.group.fill_wait_s, FILL_WAIT_AHEAD_S)
        self.group.fill_step_s = min(self.group.fill_step_s, FILL_STEP_AHEAD_S)

    def fill_wait(self, seconds: float) -> None:
        """A batch fills for `seconds` at most (0: written as soon as a leader is free), whatever the
        default or `accepting_ahead` set."""
        if not seconds >= 0:
            raise ValueError(f"fill wait must be >= 0 seconds, got {seconds}")
        self.group.fill_wait_s = seconds

    async def save(self, new: NewPlan) -> LoadPlan:
        """Write `new` in the next batch: its plan, a stored one replayed, or the refusal raised."""
        return await self._submit(new)

    async def save_made(self, make: Callable[[], NewPlan], answer: Callable[[NewPlan, LoadPlan], T]) -> T:
        """`answer(new, await save(new))` with `new = make()`, both called by the writer of the batch
        that takes it (`answer` a function of its arguments alone: it may be called before the
        commit, for the plan as made, and that result used once the commit saved it as made).
        What `make` raises is this caller's refusal (nothing saved), raised here as
        `save` raises the store's; `make` runs again if the plan goes to a later batch (a second
        plan of one request id in a batch waits for the first one's outcome)."""
        return await self._submit(_Made(make, answer))

    async def _submit(self, item: NewPlan | _Made) -> Any:
        """`item`'s outcome from the group commit; a closed writer or a wait past the store's
        `wait_timeout_s` is UNAVAILABLE (retry with the same request id)."""
        if self._closed:
            raise Unavailable("registry shutting down; retry with the same request id")
        try:
            return await self.group.submit(item)
        except GroupCommitTimeout as err:
            raise Unavailable(f"database not answering while saving a plan ({err}); retry with the same "
                              f"request id") from None

    async def _write_batch(self, items: Sequence[NewPlan | _Made]) -> list[Any]:
        """The group commit's `write_batch`: the `_Made` items' plans made, the batch written
        (`_write`), their answers derived; one outcome per item, in order."""
        outcomes: list[Any] = [None] * len(items)
        news: list[NewPlan] = []
        at: list[int] = []
        for i, item in enumerate(items):
            if item.__class__ is _Made:
                try:
                    item = item.make()
                except Exception as err:  # noqa: BLE001 - this caller's refusal, not the batch's
                    outcomes[i] = err
                    continue
            news.append(item)
            at.append(i)
        early: dict[int, Any] = {}
        pending = asyncio.get_running_loop().call_soon(_answer_early, items, at, news, early) if news else None
        started = time.perf_counter()
        try:
            written = checked_outcomes(await self._write(news), len(news)) if news else ()
        finally:
            if pending is not None:
                pending.cancel()       # not run yet (the write ended without waiting)
        if news and self.on_commit is not None:
            self.on_commit(time.perf_counter() - started, len(news))
        for i, new, outcome in zip(at, news, written):
            made = items[i]
            if made.__class__ is _Made and isinstance(outcome, LoadPlan):
                if outcome is new.plan and i in early:
                    outcome = early[i]
                else:
                    try:
                        outcome = made.answer(new, outcome)
                    except Exception as err:  # noqa: BLE001 - this caller's own error
                        outcome = err
            outcomes[i] = outcome
        return outcomes

    async def aclose(self) -> None:
        """Refuse new plans, let the batches being written finish, release what the writer holds."""
        self._closed = True
        await self.group.drain()
        await self._release()

    async def _write(self, news: Sequence[NewPlan]) -> Sequence[Any]:
        raise NotImplementedError

    async def _release(self) -> None:
        """What a subclass holds (connections)."""

    async def _blocking(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` on a thread of the executor."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


class ThreadedPlanWriter(AsyncPlanWriter):
    """Batches written by `store._save_batch` on a thread of the executor (SQLite)."""

    def __init__(self, store: "SqlPlanStore", executor: Executor | None = None, *, max_leaders: int = 1,
                 max_batch: int, fill_wait_s: float = FILL_WAIT_S):
        super().__init__(store, executor, max_leaders=max_leaders, max_batch=max_batch, fill_wait_s=fill_wait_s)

    async def _write(self, news: Sequence[NewPlan]) -> Sequence[Any]:
        return await self._blocking(self.store._save_batch, news)
