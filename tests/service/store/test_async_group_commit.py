"""AsyncGroupCommit: the coroutines of one event loop share batches (service/store/async_group_commit.py).

A fake `write_batch` records its batches and can be held open on an asyncio.Event,
so every interleaving here is decided by the test, not by timing."""

from __future__ import annotations

import asyncio

import pytest

from loadplan.service.store.async_group_commit import AsyncGroupCommit
from loadplan.service.store.group_commit import DEFER, GroupCommitTimeout


class FakeWriter:
    """Answers item * 10; `fail` items get their own error; `defer_once` items are deferred once;
    while `gate` is set up and not open, a batch waits for it; batch number n also waits for
    `holds[n]` when there is one."""

    def __init__(self, fail=(), defer_once=(), raise_batch=None):
        self.batches: list[list[int]] = []
        self.fail = set(fail)
        self.defer_once = set(defer_once)
        self.raise_batch = raise_batch
        self.gate: asyncio.Event | None = None
        self.holds: dict[int, asyncio.Event] = {}
        self.in_batch = 0
        self.most_at_once = 0

    async def __call__(self, items):
        number = len(self.batches)
        self.batches.append(list(items))
        self.in_batch += 1
        self.most_at_once = max(self.most_at_once, self.in_batch)
        try:
            if number in self.holds:
                await self.holds[number].wait()
            if self.gate is not None:
                await self.gate.wait()
            elif number not in self.holds:
                await asyncio.sleep(0)
            if self.raise_batch is not None:
                raise self.raise_batch
            out = []
            for x in items:
                if x in self.defer_once:
                    self.defer_once.discard(x)
                    out.append(DEFER)
                elif x in self.fail:
                    out.append(ValueError(f"item {x} refused"))
                else:
                    out.append(x * 10)
            return out
        finally:
            self.in_batch -= 1


def run(coro):
    return asyncio.run(coro)


def test_a_lone_caller_writes_its_own_batch():
    async def main():
        w = FakeWriter()
        g = AsyncGroupCommit(w)
        assert await g.submit(3) == 30
        assert w.batches == [[3]] and g.batches == 1 and g.leaders() == 0 and g.pending() == 0
        assert not g._tasks                               # on the caller's own coroutine: no task
    run(main())


def test_callers_that_arrive_while_a_batch_is_written_share_the_next_one():
    async def main():
        w = FakeWriter()
        w.gate = asyncio.Event()
        g = AsyncGroupCommit(w)
        first = asyncio.ensure_future(g.submit(0))
        await asyncio.sleep(0.01)               # the first batch [0] is open
        rest = [asyncio.ensure_future(g.submit(i)) for i in range(1, 20)]
        await asyncio.sleep(0.01)
        assert g.pending() == 19 and g.leaders() == 1
        w.gate.set()
        assert await first == 0
        assert await asyncio.gather(*rest) == [i * 10 for i in range(1, 20)]
        assert w.batches == [[0], list(range(1, 20))]
        assert g.items == 20 and g.largest_batch == 19
    run(main())


def test_an_item_error_fails_that_caller_only():
    async def main():
        g = AsyncGroupCommit(FakeWriter(fail={2}))
        results = await asyncio.gather(*(g.submit(i) for i in range(4)), return_exceptions=True)
        assert results[0] == 0 and results[1] == 10 and results[3] == 30
        assert isinstance(results[2], ValueError) and "item 2" in str(results[2])
    run(main())


def test_a_failing_batch_fails_each_of_its_callers_and_the_next_batch_runs():
    async def main():
        w = FakeWriter(raise_batch=ConnectionError("database gone"))
        g = AsyncGroupCommit(w)
        results = await asyncio.gather(*(g.submit(i) for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, ConnectionError) for r in results)
        w.raise_batch = None
        assert await g.submit(7) == 70
        assert g.leaders() == 0
    run(main())


def test_a_batch_answering_the_wrong_number_of_outcomes_fails_its_callers():
    async def main():
        async def short(items):
            return []
        g = AsyncGroupCommit(short)
        results = await asyncio.gather(g.submit(1), g.submit(2), g.submit(3), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) and "0 outcomes for" in str(r) for r in results), results
    run(main())


def test_deferred_items_go_to_a_later_batch():
    async def main():
        w = FakeWriter(defer_once={1})
        g = AsyncGroupCommit(w)
        assert await asyncio.gather(*(g.submit(i) for i in range(3))) == [0, 10, 20]
        assert w.batches == [[0], [1, 2], [1]]           # 0 alone; 1 deferred from [1, 2] to its own
        assert g.items == 3
        alone = FakeWriter(defer_once={5})
        g = AsyncGroupCommit(alone)
        assert await g.submit(5) == 50                   # deferred when alone too: written again later
        assert alone.batches == [[5], [5]]
    run(main())


def test_max_batch_bounds_the_batches():
    async def main():
        w = FakeWriter()
        g = AsyncGroupCommit(w, max_batch=4)
        await asyncio.gather(*(g.submit(i) for i in range(10)))
        assert max(len(b) for b in w.batches) <= 4
        assert sorted(x for b in w.batches for x in b) == list(range(10))
    run(main())


def test_several_leaders_write_batches_at_once_and_none_is_stranded():
    async def main():
        w = FakeWriter()
        g = AsyncGroupCommit(w, max_leaders=3, max_batch=5)
        for wave in range(5):   # leaders finishing while new callers come must never strand one
            got = await asyncio.gather(*(g.submit(wave * 100 + i) for i in range(37)))
            assert got == [(wave * 100 + i) * 10 for i in range(37)]
            assert g.pending() == 0
        assert w.most_at_once == 3
        await g.drain()
        assert g.leaders() == 0
    run(main())


def test_a_caller_that_arrives_as_the_last_leader_returns_is_written():
    async def main():
        w = FakeWriter()
        g = AsyncGroupCommit(w)
        for i in range(50):   # each submit lands right after the previous leader drained the queue
            assert await asyncio.wait_for(g.submit(i), 5) == i * 10   # stranded: a failure, not a hang
    run(main())


def test_a_cancelled_caller_does_not_cancel_the_batch_it_shares():
    async def main():
        w = FakeWriter()
        w.holds = {1: asyncio.Event()}
        g = AsyncGroupCommit(w)
        alone = asyncio.ensure_future(g.submit(0))       # nothing queued: writes its own batch
        mine = asyncio.ensure_future(g.submit(1))        # queued meanwhile: a leader's batch [1, 2]
        other = asyncio.ensure_future(g.submit(2))
        assert await alone == 0
        await asyncio.sleep(0.01)                        # batch [1, 2] is being written, held
        mine.cancel()                                    # its client gave up
        await asyncio.sleep(0.01)
        w.holds[1].set()
        assert await other == 20
        assert w.batches == [[0], [1, 2]]                # the shared batch ran whole
    run(main())


def test_a_lone_caller_cancelled_cuts_its_own_batch_only_and_the_queued_ones_get_a_leader():
    async def main():
        w = FakeWriter()
        w.holds = {0: asyncio.Event()}
        g = AsyncGroupCommit(w)
        alone = asyncio.ensure_future(g.submit(0))       # writes its own batch, held
        queued = [asyncio.ensure_future(g.submit(i)) for i in (1, 2)]
        await asyncio.sleep(0.01)
        alone.cancel()
        assert await asyncio.wait_for(asyncio.gather(*queued), 5) == [10, 20]
        assert w.batches == [[0], [1, 2]]
        assert g.leaders() == 0
        with pytest.raises(asyncio.CancelledError):
            await alone
    run(main())


def test_a_queued_caller_times_out_and_is_withdrawn():
    async def main():
        w = FakeWriter()
        w.gate = asyncio.Event()
        g = AsyncGroupCommit(w, timeout=0.1)
        first = asyncio.ensure_future(g.submit(1))        # writes its own batch, which hangs
        await asyncio.sleep(0.01)
        with pytest.raises(GroupCommitTimeout) as info:
            await g.submit(2)                             # queued behind it
        assert info.value.withdrawn and g.pending() == 0
        w.gate.set()
        assert await first == 10                          # a caller writing alone: bounded by its write
        await g.drain()
        assert w.batches == [[1]]                         # 2 was never written
    run(main())


def test_a_caller_whose_shared_batch_hangs_times_out_not_withdrawn():
    async def main():
        w = FakeWriter()
        w.holds = {1: asyncio.Event()}
        g = AsyncGroupCommit(w, timeout=0.2)
        alone = asyncio.ensure_future(g.submit(0))
        taken = asyncio.ensure_future(g.submit(1))        # a leader's batch [1], which hangs
        assert await alone == 0
        with pytest.raises(GroupCommitTimeout) as info:
            await taken
        assert not info.value.withdrawn                   # its batch may still commit
        w.holds[1].set()
        await g.drain()
        assert w.batches == [[0], [1]]
    run(main())


@pytest.mark.parametrize("kw", [{"max_batch": 0}, {"max_leaders": 0}, {"timeout": 0}, {"timeout": -1},
                                {"fill_wait_s": -1}, {"fill_step_s": 0}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        AsyncGroupCommit(FakeWriter(), **kw)


def test_under_load_a_batch_fills_while_callers_keep_arriving():
    async def main():
        w = FakeWriter()
        w.gate = asyncio.Event()
        g = AsyncGroupCommit(w, fill_wait_s=2.0, fill_step_s=0.05)
        first = asyncio.ensure_future(g.submit(0))            # batch [0], held open
        await asyncio.sleep(0.01)
        queued = [asyncio.ensure_future(g.submit(i)) for i in range(1, 4)]
        await asyncio.sleep(0.01)

        async def trickle():                                   # more callers, well within a step apart
            for i in range(4, 9):
                await asyncio.sleep(0.01)
                queued.append(asyncio.ensure_future(g.submit(i)))

        started = asyncio.get_running_loop().time()
        w.gate.set()
        await asyncio.gather(first, trickle())
        await asyncio.gather(*queued)
        took = asyncio.get_running_loop().time() - started
        assert w.batches == [[0], list(range(1, 9))]           # the second batch waited for the trickle
        assert took < 1.0                                      # and stopped once the queue stopped growing
    run(main())


def test_a_lone_caller_is_not_made_to_wait_for_company():
    async def main():
        g = AsyncGroupCommit(FakeWriter(), fill_wait_s=5.0, fill_step_s=1.0)
        loop = asyncio.get_running_loop()
        for i in range(3):
            started = loop.time()
            assert await g.submit(i) == i * 10
            assert loop.time() - started < 0.5
    run(main())


def test_answered_callers_are_not_kept_for_their_deadline():
    async def main():
        g = AsyncGroupCommit(FakeWriter(), timeout=60)
        for i in range(200):
            await g.submit(i)
        assert len(g._waiting) <= 1           # each new caller drops the answered ones before it
    run(main())


def test_callers_time_out_in_arrival_order_each_at_its_own_deadline():
    async def main():
        w = FakeWriter()
        w.holds = {0: asyncio.Event()}
        g = AsyncGroupCommit(w, timeout=0.2)
        loop = asyncio.get_running_loop()
        alone = asyncio.ensure_future(g.submit(0))        # holds the only leader slot
        await asyncio.sleep(0.01)
        first = asyncio.ensure_future(g.submit(1))
        await asyncio.sleep(0.1)
        second = asyncio.ensure_future(g.submit(2))
        started = loop.time()
        with pytest.raises(GroupCommitTimeout):
            await first
        first_at = loop.time() - started
        with pytest.raises(GroupCommitTimeout):
            await second
        second_at = loop.time() - started
        assert first_at < 0.15 <= second_at < 1.0, (first_at, second_at)
        w.holds[0].set()
        assert await alone == 0
        await g.drain()
        assert w.batches == [[0]]                          # both withdrawn before any batch took them
    run(main())
