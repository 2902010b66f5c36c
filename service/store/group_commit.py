"""Group commit: callers that write at the same time share one transaction.

A durable commit costs one WAL flush (fsync) whether it carries one plan or a
hundred, so under load the store writes every plan that is waiting in one
transaction. Leader-follower, no writer thread of its own:

- a caller queues its item; if no batch is being written it becomes the leader,
  takes everything queued (up to `max_batch`), writes it with `write_batch` and
  hands each waiter its own outcome;
- callers that arrive while a batch is being written queue up and sleep; when
  the leader is done it wakes the first of them to lead the next batch (which
  then holds everything that queued meanwhile) and returns to its own caller.

So a lone caller writes its own batch of one on its own thread (no hand-off
latency), and under load the batch grows with the time a commit takes.

`write_batch(items)` returns one outcome per item, in order: the result, an
exception instance (raised in that caller's thread), or `DEFER` (the item goes
to the front of the next batch, e.g. a second call with the same request id,
which must see the first one committed). An exception raised by `write_batch`
itself fails every item of the batch. A caller returns only after the batch
holding its item has been written; what "written" means (committed) is
`write_batch`'s business.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Generic, Sequence, TypeVar

T = TypeVar("T")

DEFER = object()   # outcome: retry this item in the next batch


class _Slot:
    __slots__ = ("item", "outcome", "done", "wake")

    def __init__(self, item: Any):
        self.item = item
        self.outcome: Any = None
        self.done = False
        # Held until the slot's thread is woken, with its outcome or to lead; cheaper than an Event.
        self.wake = threading.Lock()
        self.wake.acquire()


class GroupCommit(Generic[T]):
    def __init__(self, write_batch: Callable[[Sequence[T]], Sequence[Any]], *, max_batch: int = 256):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._write_batch = write_batch
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[_Slot] = []
        self._leading = False             # invariant: queue not empty => a leader is running or woken
        # Counters for tests and tuning (read without the lock: approximate).
        self.batches = 0
        self.items = 0
        self.largest_batch = 0

    def submit(self, item: T) -> Any:
        """Write `item` in the next batch; return its outcome or raise its exception."""
        slot = _Slot(item)
        with self._lock:
            self._queue.append(slot)
            lead = not self._leading
            self._leading = True
        if not lead:
            slot.wake.acquire()           # sleep until the outcome, or the lead, comes
        while not slot.done:
            self._lead_one_batch()
            if not slot.done:             # deferred: sleep until woken again (maybe to lead)
                slot.wake.acquire()
        if isinstance(slot.outcome, BaseException):
            raise slot.outcome
        return slot.outcome

    def _lead_one_batch(self) -> None:
        with self._lock:
            batch = self._queue[:self.max_batch]
            del self._queue[:self.max_batch]
        try:
            outcomes = list(self._write_batch([s.item for s in batch]))
            if len(outcomes) != len(batch):
                raise RuntimeError(f"write_batch returned {len(outcomes)} outcomes for {len(batch)} items")
        except BaseException as exc:  # noqa: BLE001 - every caller of the batch gets it
            outcomes = [exc] * len(batch)
        deferred = []
        finished = []
        for slot, outcome in zip(batch, outcomes):
            if outcome is DEFER:
                deferred.append(slot)
            else:
                slot.outcome, slot.done = outcome, True
                finished.append(slot)
        self.batches += 1
        self.items += len(finished)
        self.largest_batch = max(self.largest_batch, len(batch))
        with self._lock:
            self._queue[:0] = deferred
            nxt = self._queue[0] if self._queue else None
            if nxt is None:
                self._leading = False     # else the lead passes on to `nxt`: `_leading` stays True
        for slot in finished:
            if slot.wake.locked():
                slot.wake.release()
        if nxt is not None and nxt.wake.locked():
            nxt.wake.release()
