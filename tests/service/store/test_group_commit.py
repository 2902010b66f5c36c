"""GroupCommit on its own: a fake writer, no database."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from loadplan.service.store.group_commit import DEFER, GroupCommit


class RecordingWriter:
    """write_batch fake: records each batch, answers item * 10, raises items that are exceptions."""

    def __init__(self, delay_s: float = 0.0):
        self.batches: list[list] = []
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.deferred_once: set = set()

    def __call__(self, items):
        with self.lock:
            self.batches.append(list(items))
        time.sleep(self.delay_s)   # a commit takes time: callers queue meanwhile
        out = []
        for item in items:
            if isinstance(item, BaseException):
                out.append(item)
            elif isinstance(item, str) and item.startswith("defer") and item not in self.deferred_once:
                self.deferred_once.add(item)
                out.append(DEFER)
            else:
                out.append(item * 10 if isinstance(item, int) else item.upper())
        return out


def _submit_all(gc, items, workers=None):
    barrier = threading.Barrier(len(items))

    def one(item):
        barrier.wait()
        try:
            return gc.submit(item)
        except Exception as exc:  # noqa: BLE001
            return exc

    with ThreadPoolExecutor(max_workers=workers or len(items)) as pool:
        return list(pool.map(one, items))


def test_a_lone_caller_writes_its_own_batch():
    writer = RecordingWriter()
    gc = GroupCommit(writer)
    assert [gc.submit(i) for i in range(3)] == [0, 10, 20]
    assert writer.batches == [[0], [1], [2]]


def test_concurrent_callers_share_batches_and_each_gets_its_own_outcome():
    writer = RecordingWriter(delay_s=0.02)
    gc = GroupCommit(writer)
    items = list(range(40))
    assert _submit_all(gc, items) == [i * 10 for i in items]
    assert sorted(i for b in writer.batches for i in b) == items   # each item written exactly once
    assert len(writer.batches) < len(items)                          # ...and some shared a batch
    assert gc.pending() == 0


def test_an_item_error_fails_that_caller_only():
    writer = RecordingWriter(delay_s=0.01)
    gc = GroupCommit(writer)
    boom = ValueError("this one")
    results = _submit_all(gc, [1, boom, 3, 4])
    assert results[0] == 10 and results[2] == 30 and results[3] == 40
    assert results[1] is boom


def test_a_failing_batch_fails_each_of_its_callers_and_the_next_batch_runs():
    calls = []

    def write(items):
        calls.append(list(items))
        if len(calls) == 1:
            raise RuntimeError("connection lost")
        return [i for i in items]

    gc = GroupCommit(write)
    with pytest.raises(RuntimeError, match="connection lost"):
        gc.submit(1)
    assert gc.submit(2) == 2   # the leadership was given back


def test_deferred_items_go_to_a_later_batch():
    writer = RecordingWriter(delay_s=0.01)
    gc = GroupCommit(writer)
    results = _submit_all(gc, ["a", "defer-b", "c"])
    assert results == ["A", "DEFER-B", "C"]
    first = next(i for i, b in enumerate(writer.batches) if "defer-b" in b)
    assert any("defer-b" in b for b in writer.batches[first + 1:])


def test_max_batch_bounds_the_batches():
    writer = RecordingWriter(delay_s=0.02)
    gc = GroupCommit(writer, max_batch=4)
    assert _submit_all(gc, list(range(20))) == [i * 10 for i in range(20)]
    assert max(len(b) for b in writer.batches) <= 4


def test_max_batch_must_be_positive():
    with pytest.raises(ValueError, match="max_batch"):
        GroupCommit(lambda items: items, max_batch=0)


def test_several_leaders_write_batches_at_once_and_never_lose_the_lead():
    # Two batches in flight at a time; callers arrive in waves, some deferred once. Every call must
    # come back (a leader lost on the way would leave callers queued forever).
    import random

    rng = random.Random(7)
    in_flight, most = [0], [0]
    lock = threading.Lock()
    deferred_once: set = set()

    def write(items):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(rng.random() * 0.01)
        with lock:
            in_flight[0] -= 1
            out = []
            for item in items:
                if item % 7 == 0 and item not in deferred_once:
                    deferred_once.add(item)
                    out.append(DEFER)
                else:
                    out.append(item * 10)
        return out

    gc = GroupCommit(write, max_leaders=2)
    for wave in range(5):
        items = list(range(wave * 100, wave * 100 + 30))
        with ThreadPoolExecutor(max_workers=len(items)) as pool:
            futures = [pool.submit(gc.submit, i) for i in items]
            assert [f.result(timeout=30) for f in futures] == [i * 10 for i in items]
    assert most[0] == 2
    assert gc.pending() == 0 and gc.submit(1) == 10
