"""GroupCommit with a timeout: a caller waiting behind a batch that does not come back gives
up in bounded time, and says whether its item was written (withdrawn: never handed to a batch)."""

from __future__ import annotations

import threading
import time

import pytest

from loadplan.service.store.group_commit import GroupCommit, GroupCommitTimeout


class GatedWriter:
    """write_batch fake: each batch waits for its own gate; answers item * 10."""

    def __init__(self):
        self.batches: list[list] = []
        self.entered = threading.Semaphore(0)
        self.gates = [threading.Event() for _ in range(8)]

    def __call__(self, items):
        n = len(self.batches)
        self.batches.append(list(items))
        self.entered.release()
        assert self.gates[n].wait(10), "test gate never opened"
        return [i * 10 for i in items]


def _submit(gc, item, out):
    def run():
        t = time.monotonic()
        try:
            out[item] = ("ok", gc.submit(item), time.monotonic() - t)
        except GroupCommitTimeout as e:
            out[item] = ("timeout", e.withdrawn, time.monotonic() - t)
    th = threading.Thread(target=run)
    th.start()
    return th


def _until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never met"
        time.sleep(0.005)


def test_a_queued_follower_times_out_and_is_withdrawn():
    writer = GatedWriter()
    gc = GroupCommit(writer, timeout=0.3)
    out: dict = {}
    leader = _submit(gc, 1, out)
    assert writer.entered.acquire(timeout=5)
    follower = _submit(gc, 2, out)
    follower.join(5)
    assert out[2][0] == "timeout" and out[2][1] is True   # withdrawn: never written
    assert 0.25 <= out[2][2] < 2.0
    assert gc.pending() == 0
    writer.gates[0].set()
    leader.join(5)
    assert out[1][:2] == ("ok", 10)
    assert writer.batches == [[1]]                          # the withdrawn item was not written later


def test_a_follower_whose_batch_hangs_times_out_not_withdrawn():
    writer = GatedWriter()
    gc = GroupCommit(writer, timeout=0.5)
    out: dict = {}
    first = _submit(gc, 1, out)
    assert writer.entered.acquire(timeout=5)
    second, third = _submit(gc, 2, out), _submit(gc, 3, out)
    _until(lambda: gc.pending() == 2)
    writer.gates[0].set()                                   # batch [1] done; 2 leads [2, 3], which hangs
    assert writer.entered.acquire(timeout=5)
    third.join(5)
    assert out[3][0] == "timeout" and out[3][1] is False    # handed to a batch: it may still commit
    writer.gates[1].set()
    first.join(5), second.join(5)
    assert out[1][:2] == ("ok", 10) and out[2][:2] == ("ok", 20)
    assert writer.batches == [[1], [2, 3]]


def test_without_a_timeout_followers_wait():
    writer = GatedWriter()
    gc = GroupCommit(writer)
    out: dict = {}
    leader = _submit(gc, 1, out)
    assert writer.entered.acquire(timeout=5)
    follower = _submit(gc, 2, out)
    time.sleep(0.3)
    assert 2 not in out
    writer.gates[0].set()
    writer.gates[1].set()
    leader.join(5), follower.join(5)
    assert out[1][:2] == ("ok", 10) and out[2][:2] == ("ok", 20)


@pytest.mark.parametrize("bad", [0, -1])
def test_timeout_must_be_positive(bad):
    with pytest.raises(ValueError, match="timeout"):
        GroupCommit(lambda items: items, timeout=bad)
