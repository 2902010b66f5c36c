"""Group commit: callers that write at the same time share one transaction.

A durable commit costs one WAL flush (fsync) whether it carries one plan or a
hundred, so under load the store writes every plan that is waiting in one
transaction. Leader-follower, no writer thread of its own:

- a caller queues its item; if fewer than `max_leaders` batches are being
  written it becomes a leader: it takes everything queued (up to `max_batch`),
  writes it with `write_batch` and hands each waiter its own outcome;
- callers that arrive meanwhile queue up and sleep; a leader that is done
  wakes the first of them to lead the next batch (which then holds everything
  that queued meanwhile) and returns to its own caller.

So a lone caller writes its own batch of one on its own thread (no hand-off
latency), and under load a batch grows with the time a commit takes. With
`max_leaders` > 1 a batch can run its statements while the one before waits for
its commit; `write_batch` must then be safe to run concurrently (the database
arbitrates between concurrent batches as between registry replicas).

`write_batch(items)` returns one outcome per item, in order: the result, an
exception instance (raised in that caller's thread), or `DEFER` (the item goes
to the front of the queue for a later batch, e.g. a second call with the same
request id, which must see the first one committed). An exception raised by
`write_batch` itself fails every item of the batch. A caller returns only after
the batch holding its item has been written; what "written" means (committed)
is `write_batch`'s business.

With `timeout`, a follower waits at most that long for its outcome and then
raises `GroupCommitTimeout`: its item is withdrawn if no batch took it yet, else
its batch may still commit (the caller cannot know; a retry with the same
request id replays it). A leader is bounded by `write_batch` alone.
"""

from __future__ import annotations

import _thread
import threading
import time
from typing import Any, Callable, Generic, Sequence, TypeVar

T = TypeVar("T")

DEFER = object()   # outcome: retry this item in the next batch


class GroupCommitTimeout(TimeoutError):
    """No outcome within the timeout; `withdrawn`: the item was never handed to a batch."""

    def __init__(self, seconds: float, withdrawn: bool):
        state = "not written" if withdrawn else "its batch still running (it may commit)"
        super().__init__(f"no outcome within {seconds:g}s ({state})")
        self.withdrawn = withdrawn


class _Slot:
    __slots__ = ("item", "outcome", "done", "lead", "wake")

    def __init__(self, item: Any):
        self.item = item
        self.outcome: Any = None
        self.done = False                 # outcome set            } both under GroupCommit._lock;
        self.lead = False                 # asked to lead a batch  } `_wake` follows either
        # A bare lock as a binary signal: released = "look again". threading.Event is a Condition
        # in Python code; with dozens of RPC threads per batch, its wait/notify was a quarter of
        # the registry's GIL time under load (py-spy --gil). acquire/release are single C calls.
        self.wake = _thread.allocate_lock()
        self.wake.acquire()


def _wake(slot: _Slot) -> None:
    """Signal `slot` (under GroupCommit._lock, so two wakers never both release)."""
    if slot.wake.locked():
        slot.wake.release()


def check_settings(max_batch: int, max_leaders: int, timeout: float | None) -> None:
    """ValueError naming the setting of a group commit (this one or AsyncGroupCommit) that is wrong."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if max_leaders < 1:
        raise ValueError(f"max_leaders must be >= 1, got {max_leaders}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be > 0 or None, got {timeout}")


def checked_outcomes(outcomes: Sequence[Any], items: int) -> list[Any]:
    """`write_batch`'s outcomes as a list, one per item, or RuntimeError (a `write_batch` bug)."""
    outcomes = list(outcomes)
    if len(outcomes) != items:
        raise RuntimeError(f"write_batch returned {len(outcomes)} outcomes for {items} items")
    return outcomes


class GroupCommit(Generic[T]):
    def __init__(self, write_batch: Callable[[Sequence[T]], Sequence[Any]], *, max_batch: int = 256,
                 max_leaders: int = 1, timeout: float | None = None):
        check_settings(max_batch, max_leaders, timeout)
        self._write_batch = write_batch
        self.timeout = timeout
        self.max_batch = max_batch
        # Batches written at the same time: more than one lets a batch run its statements while
        # the one before waits for its commit (write_batch must then be safe to run concurrently).
        self.max_leaders = max_leaders
        self._lock = threading.Lock()
        self._queue: list[_Slot] = []
        self._leaders = 0                 # leading or asked to; queue not empty => at least one
        # Counters for tests and tuning (approximate when read without the lock).
        self.batches = 0
        self.items = 0
        self.largest_batch = 0

    def pending(self) -> int:
        """Items queued for a batch not started yet."""
        with self._lock:
            return len(self._queue)

    def submit(self, item: T) -> Any:
        """Write `item` in the next batch; return its outcome or raise its exception."""
        slot = _Slot(item)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._lock:
            self._queue.append(slot)
            if self._leaders < self.max_leaders:
                self._leaders += 1
                slot.lead = True
        while True:
            with self._lock:
                lead = slot.lead
                if lead:
                    slot.lead = False
                elif slot.done:
                    break
                else:
                    slot.wake.acquire(False)   # consume a stale signal; the next comes with an outcome or a lead
            if lead:
                self._lead_one_batch()
            elif deadline is None:
                slot.wake.acquire()
            elif not slot.wake.acquire(timeout=max(0.0, deadline - time.monotonic())):
                with self._lock:
                    if slot.lead or slot.done:
                        continue          # the answer (or the lead) came just now: take it
                    withdrawn = slot in self._queue
                    if withdrawn:
                        self._queue.remove(slot)
                raise GroupCommitTimeout(self.timeout, withdrawn)
        if isinstance(slot.outcome, BaseException):
            raise slot.outcome
        return slot.outcome

    def _lead_one_batch(self) -> None:
        """Write what is queued (maybe nothing, if another leader took it), then pass the lead on."""
        with self._lock:
            batch = self._queue[:self.max_batch]
            del self._queue[:self.max_batch]
        outcomes: list[Any] = []
        if batch:
            try:
                outcomes = checked_outcomes(self._write_batch([s.item for s in batch]), len(batch))
            except BaseException as exc:  # noqa: BLE001 - every caller of the batch gets it
                outcomes = [exc] * len(batch)
        woken = []
        with self._lock:
            deferred = []
            for slot, outcome in zip(batch, outcomes):
                if outcome is DEFER:
                    deferred.append(slot)
                else:
                    slot.outcome, slot.done = outcome, True
                    woken.append(slot)
            self._queue[:0] = deferred
            nxt = next((s for s in self._queue if not s.lead), None)
            if nxt is None:
                self._leaders -= 1
            else:
                nxt.lead = True           # the lead passes on; the count of leaders stays
                woken.append(nxt)
            if batch:
                self.batches += 1
                self.items += len(batch) - len(deferred)
                self.largest_batch = max(self.largest_batch, len(batch))
            for slot in woken:
                _wake(slot)
