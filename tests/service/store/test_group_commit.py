"""GroupCommit (service/store/group_commit.py): the plans saved while a batch is written go in
the next batch, each caller gets its own outcome, and `on_commit` hears every batch."""

from __future__ import annotations

import asyncio

import pytest

from loadplan.errors import FailedPrecondition, Unavailable
from loadplan.service.store.group_commit import GroupCommit


class FakeBatches:
    """A `save_batch` that records its batches and answers each item with itself (a str) or
    with the exception it is; `gate` holds a batch back until set."""

    def __init__(self):
        self.batches: list[list] = []
        self.gate: asyncio.Event | None = None
        self.fail_next: Exception | None = None

    def save_batch(self, items):
        self.batches.append(list(items))
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err
        return list(items)

    async def run_blocking(self, fn, *args):
        if self.gate is not None:
            await self.gate.wait()
        return fn(*args)


def test_plans_saved_while_a_batch_is_written_share_the_next_one():
    fake = FakeBatches()
    commits: list[tuple[float, int]] = []

    async def main():
        fake.gate = asyncio.Event()
        group = GroupCommit(fake.save_batch, run_blocking=fake.run_blocking,
                            on_commit=lambda s, n: commits.append((s, n)))
        first = asyncio.create_task(group.save("a"))
        await asyncio.sleep(0.01)                 # "a" is being written (held at the gate)
        rest = [asyncio.create_task(group.save(x)) for x in "bcd"]
        await asyncio.sleep(0.01)
        fake.gate.set()
        return await first, await asyncio.gather(*rest)

    assert asyncio.run(main()) == ("a", ["b", "c", "d"])
    assert fake.batches == [["a"], ["b", "c", "d"]]
    assert [n for _, n in commits] == [1, 3] and all(s >= 0 for s, _ in commits)


def test_a_refusal_is_its_callers_and_a_failed_batch_fails_only_its_plans():
    fake = FakeBatches()
    refused = FailedPrecondition("pinned to other inputs", field="runtime.a2a_backend")

    async def main():
        group = GroupCommit(fake.save_batch, run_blocking=fake.run_blocking)
        ok, no = await asyncio.gather(group.save("ok"), group.save(refused), return_exceptions=True)
        fake.fail_next = Unavailable("database unavailable while saving a plan")
        down = await asyncio.gather(group.save("x"), group.save("y"), return_exceptions=True)
        after = await group.save("z")            # the next batch is written as ever
        return ok, no, down, after

    ok, no, down, after = asyncio.run(main())
    assert ok == "ok" and no is refused
    assert all(isinstance(e, Unavailable) for e in down) and len(down) == 2
    assert after == "z"


def test_a_batch_holds_at_most_max_batch_plans():
    fake = FakeBatches()

    async def main():
        group = GroupCommit(fake.save_batch, run_blocking=fake.run_blocking, max_batch=2)
        return await asyncio.gather(*(group.save(i) for i in range(5)))

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
    assert [len(b) for b in fake.batches] == [2, 2, 1]


async def arrives(group: GroupCommit, name: str, turns: int):
    """`group.save(name)` after `turns` turns of the loop (a resolve still deciding)."""
    for _ in range(turns):
        await asyncio.sleep(0)
    return await group.save(name)


def test_plans_decided_in_the_loop_turns_before_a_batch_is_taken_join_it():
    """Resolves whose requests have arrived are still deciding, a turn or two of the loop each
    (`arrives`), when the first plan is queued: they join its batch instead of waiting for its
    commit. After a lone plan (as here, the first) the batch is taken once a turn of the loop
    adds nothing, so a plan whose caller is still waiting for something else (`late`) goes in
    the next one."""
    fake = FakeBatches()

    async def late(group: GroupCommit):
        await asyncio.sleep(0.01)
        return await group.save("late")

    async def main():
        group = GroupCommit(fake.save_batch, run_blocking=fake.run_blocking)
        return await asyncio.gather(group.save("a"), arrives(group, "b", 1), arrives(group, "c", 2),
                                    arrives(group, "d", 3), late(group))

    assert asyncio.run(main()) == ["a", "b", "c", "d", "late"]
    assert fake.batches == [["a", "b", "c", "d"], ["late"]]


def test_after_a_batch_of_n_plans_the_next_one_waits_n_quiet_turns_for_more():
    """The quiet turns a batch waits for its next plan are the size of the batch before it: plans
    that come three turns apart share a batch after a batch of four, and go one by one after a
    lone plan; a lone plan then brings the wait back to one turn."""
    def trickle(burst: int) -> list[list[str]]:
        fake = FakeBatches()

        async def main():
            group = GroupCommit(fake.save_batch, run_blocking=fake.run_blocking)
            await asyncio.gather(*(group.save(f"burst{i}") for i in range(burst)))
            await asyncio.gather(group.save("e"), arrives(group, "f", 3), arrives(group, "g", 6))
            await group.save("h")
            await asyncio.gather(group.save("i"), arrives(group, "j", 3))

        asyncio.run(main())
        return fake.batches[1:]

    assert trickle(4) == [["e", "f", "g"], ["h"], ["i"], ["j"]]
    assert trickle(1) == [["e"], ["f"], ["g"], ["h"], ["i"], ["j"]]


def test_a_lone_plan_is_written_after_one_turn_of_the_loop():
    fake = FakeBatches()
    turns = 0

    async def count_turns(stop: asyncio.Event):
        nonlocal turns
        while not stop.is_set():
            turns += 1
            await asyncio.sleep(0)

    async def main():
        group = GroupCommit(fake.save_batch, run_blocking=fake.run_blocking)
        stop = asyncio.Event()
        counter = asyncio.create_task(count_turns(stop))
        await asyncio.sleep(0)
        turns_before = turns
        saved = await group.save("alone")
        stop.set()
        await counter
        return saved, turns_before

    saved, turns_before = asyncio.run(main())
    assert saved == "alone" and fake.batches == [["alone"]]
    assert turns - turns_before <= 3   # the writer's start, one turn to look for more, the answer


def test_a_caller_that_went_away_does_not_stop_the_batch():
    fake = FakeBatches()

    async def main():
        fake.gate = asyncio.Event()
        group = GroupCommit(fake.save_batch, run_blocking=fake.run_blocking)
        gone = asyncio.create_task(group.save("gone"))
        await asyncio.sleep(0.01)
        gone.cancel()
        stays = asyncio.create_task(group.save("stays"))
        fake.gate.set()
        return await stays

    assert asyncio.run(main()) == "stays"
    assert fake.batches == [["gone"], ["stays"]]   # written all the same (its retry would replay)


def test_max_batch_must_be_positive():
    with pytest.raises(ValueError, match="max_batch"):
        GroupCommit(lambda items: items, max_batch=0)
