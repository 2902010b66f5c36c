"""`AsyncGroupCommit`: group commit for the coroutines of one event loop.

The registry's server is grpc.aio: a resolve is a coroutine, and it awaits its
plan's batch here instead of parking a thread (service/store/group_commit.py is
the same idea for threads, with the same `write_batch` contract):

- `submit(item)` queues the item; while fewer than `max_leaders` batches are
  being written, a leader task starts, which writes what is queued (up to
  `max_batch`) with `await write_batch(items)` and then the next batch, while
  anything is queued;
- `write_batch` returns one outcome per item, in order: the result, an
  exception instance (raised to that caller), or `DEFER` (the item goes back to
  the front of the queue for a later batch). An exception raised by
  `write_batch` itself fails every item of the batch;
- a caller returns once the batch holding its item has been written; what
  "written" means (committed) is `write_batch`'s business.

Leaders are tasks of their own, not the callers' coroutines: a caller whose RPC
is cancelled (its client gave up) must not cancel the batch it shares with
others. The exception is a lone caller (nothing queued, nothing being written,
the last batch a single item): it writes its batch of one on its own coroutine,
saving a task start and a switch (a sequential caller's latency); cancelled, it
cuts short only that batch, and whoever queued meanwhile gets a leader.

With `timeout`, a queued caller waits at most that long and then gets
`GroupCommitTimeout`: `withdrawn` when no batch had taken its item (it will never
be written), else its batch may still commit. A lone caller is bounded by its
own `write_batch`, as a leader is.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Awaitable, Callable, Generic, Sequence, TypeVar

from .group_commit import DEFER, GroupCommitTimeout, check_settings, checked_outcomes

T = TypeVar("T")


class _Waiter:
    __slots__ = ("item", "future", "taken", "deadline")

    def __init__(self, item: Any, future: asyncio.Future, deadline: float):
        self.item = item
        self.future = future
        self.taken = False       # handed to a batch: it may commit even if its caller gave up
        self.deadline = deadline


class AsyncGroupCommit(Generic[T]):
    def __init__(self, write_batch: Callable[[Sequence[T]], Awaitable[Sequence[Any]]], *, max_batch: int = 256,
                 max_leaders: int = 1, timeout: float | None = None, fill_wait_s: float = 0.0,
                 fill_step_s: float = 0.0005):
        check_settings(max_batch, max_leaders, timeout)
        if fill_wait_s < 0 or fill_step_s <= 0:
            raise ValueError(f"fill_wait_s must be >= 0 and fill_step_s > 0, got {fill_wait_s}, {fill_step_s}")
        self._write_batch = write_batch
        self.max_batch = max_batch
        self.max_leaders = max_leaders
        self.timeout = timeout
        # A batch's cost is mostly per batch (a round trip, a WAL flush, the database's per-statement
        # work: 0.18 ms of PostgreSQL CPU for a batch of 1, 0.04 ms a plan in batches of 16), so under
        # load a leader lets the batch fill a little before writing it (`_let_the_batch_fill`); a lone
        # caller (nothing else queued, the last batch a single plan) is written at once.
        self.fill_wait_s = fill_wait_s
        self.fill_step_s = fill_step_s
        self._last_batch = 0
        self._queue: list[_Waiter] = []
        # Leaders started and not yet returned, counted when they return (not when their task's
        # done callback runs, a loop iteration later, which would strand an item queued between).
        self._leading = 0
        self._tasks: set[asyncio.Task] = set()
        # Callers with a deadline, in arrival order (done ones dropped as the sweep meets them).
        self._waiting: collections.deque[_Waiter] = collections.deque()
        self._sweep: asyncio.TimerHandle | None = None
        # Counters for tests and tuning.
        self.batches = 0
        self.items = 0
        self.largest_batch = 0

    def pending(self) -> int:
        """Items queued for a batch not started yet."""
        return len(self._queue)

    def leaders(self) -> int:
        """Batches being written (leader tasks running)."""
        return self._leading

    async def submit(self, item: T) -> Any:
        """Write `item` in the next batch; return its outcome or raise its exception."""
        if not self._queue and self._leading < self.max_leaders and self._last_batch <= 1:
            return await self._write_alone(item)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(item, loop.create_future(), 0.0 if self.timeout is None else loop.time() + self.timeout)
        self._queue.append(waiter)
        if self._leading < self.max_leaders:
            self._start_leader(loop)
        if self.timeout is not None:
            waiting = self._waiting
            while waiting and waiting[0].future.done():   # answered: nothing to time out (nor to keep)
                waiting.popleft()
            waiting.append(waiter)
            if self._sweep is None:
                self._sweep = loop.call_at(waiter.deadline, self._expire)
        return await waiter.future

    def _expire(self) -> None:
        """Fail the callers whose wait is over; then sleep until the next one's deadline.
        One timer for the whole group, not one per caller (a heap push and a cancel per resolve):
        callers wait in arrival order, so the oldest one still waiting is the next to expire."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        waiting = self._waiting
        while waiting and (waiting[0].future.done() or waiting[0].deadline <= now):
            waiter = waiting.popleft()
            if waiter.future.done():
                continue
            if not waiter.taken:
                self._queue.remove(waiter)
            waiter.future.set_exception(GroupCommitTimeout(self.timeout, withdrawn=not waiter.taken))
        self._sweep = loop.call_at(waiting[0].deadline, self._expire) if waiting else None

    async def _write_alone(self, item: T) -> Any:
        """Nothing queued, nothing being written: the caller writes its batch of one on its own
        coroutine, with no leader task to start and switch to (a lone caller's latency). Bounded
        by `write_batch` alone, as a leader is; whoever queued meanwhile gets a leader after it.
        A caller cancelled meanwhile cuts short its own batch only."""
        self._leading += 1
        try:
            (outcome,) = checked_outcomes(await self._write_batch([item]), 1)
        finally:
            self._leading -= 1
            if self._queue and self._leading < self.max_leaders:
                self._start_leader(asyncio.get_running_loop())
        self._count(1, deferred=int(outcome is DEFER))
        if outcome is DEFER:
            return await self.submit(item)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _start_leader(self, loop: asyncio.AbstractEventLoop) -> None:
        self._leading += 1
        task = loop.create_task(self._lead())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait until the batches being written are done (and whatever queued meanwhile)."""
        while self._leading:
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            else:
                await asyncio.sleep(0.005)   # a caller writing its own batch: no task to wait on

    async def _lead(self) -> None:
        try:
            await self._lead_batches()
        finally:
            self._leading -= 1

    async def _lead_batches(self) -> None:
        while self._queue:
            if self.fill_wait_s and (len(self._queue) > 1 or self._last_batch > 1):
                await self._let_the_batch_fill()
            batch = self._queue[:self.max_batch]
            del self._queue[:self.max_batch]
            for w in batch:
                w.taken = True
            try:
                outcomes = checked_outcomes(await self._write_batch([w.item for w in batch]), len(batch))
            except Exception as exc:  # noqa: BLE001 - every caller of the batch gets it
                outcomes = [exc] * len(batch)
            except BaseException as exc:  # cancelled (the loop is shutting down): the callers hear it
                for w in batch:
                    if not w.future.done():
                        w.future.set_exception(exc)
                raise
            deferred = []
            for w, outcome in zip(batch, outcomes):
                if outcome is DEFER:
                    w.taken = False
                    if not w.future.done():
                        deferred.append(w)
                elif w.future.done():
                    pass                          # its caller gave up waiting
                elif isinstance(outcome, BaseException):
                    w.future.set_exception(outcome)
                else:
                    w.future.set_result(outcome)
            self._queue[:0] = deferred
            self._count(len(batch), len(deferred))

    def _count(self, size: int, deferred: int) -> None:
        self.batches += 1
        self.items += size - deferred
        self.largest_batch = max(self.largest_batch, size)
        self._last_batch = size

    async def _let_the_batch_fill(self) -> None:
        """Under load, wait while plans keep arriving (the queue grew during the last
        `fill_step_s`), at most `fill_wait_s` in all or until a batch is full."""
        waited = 0.0
        while waited < self.fill_wait_s and len(self._queue) < self.max_batch:
            before = len(self._queue)
            await asyncio.sleep(self.fill_step_s)
            waited += self.fill_step_s
            if len(self._queue) == before:
                return
