"""AsyncPlanWriter.save_made: plans made, written and answered by the writer of their batch
(service/store/async_writer.py).

`FakeAsyncWriter` (tests/service/fake_store.py) writes a batch into a `FakePlanStore` and records
its batches; the plans here record when they are made, so what the writer does with a batch is
observed, not assumed."""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # tests/service: the fake store

from fake_store import FakeAsyncWriter, FakePlanStore  # noqa: E402
from sample_requests import deepseek_config, request  # noqa: E402

from loadplan.plan import LoadPlan, Parallel  # noqa: E402
from loadplan.service.errors import InvalidArgument, Unavailable  # noqa: E402
from loadplan.service.registry import NewPlan, Registry  # noqa: E402

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)


@pytest.fixture
def registry_and_first():
    store = FakePlanStore()
    registry = Registry(store, clock=lambda: NOW)
    first = registry.new_plan(request(deepseek_config(), parallel=Parallel(ep_size=2, ep_rank=0),
                                      request_id="r-first", deployment_id="dep-first"))
    return registry, first, store


def maker(writer: FakeAsyncWriter, registry: Registry, first: NewPlan, request_id: str, deployment_id: str):
    def make() -> NewPlan:
        writer.events.append(("made", request_id))
        return registry.new_plan_like(first, request_id, deployment_id)
    return make


def answer(new: NewPlan, plan: LoadPlan):
    return ("new" if plan is new.plan else "stored", plan.plan_id, plan.request.request_id)


def behind_a_held_batch(writer, registry, first, calls, before_release=lambda: None) -> list:
    """r-0's batch (of one) held open while `calls` ((request id, deployment id, answer) each) queue
    behind it, so they share the next batch; then released. Every caller's outcome, r-0's first,
    exceptions included; `before_release()` runs just before the release (its result comes last)."""
    async def main():
        writer.gate = asyncio.Event()
        held = asyncio.ensure_future(writer.save_made(maker(writer, registry, first, "r-0", "dep-0"), answer))
        await asyncio.sleep(0)
        queued = [asyncio.ensure_future(writer.save_made(maker(writer, registry, first, rid, did), how))
                  for rid, did, how in calls]
        await asyncio.sleep(0)
        seen = before_release()
        writer.gate.set()
        return [*await asyncio.gather(held, *queued, return_exceptions=True), seen]
    return asyncio.run(main())


def test_concurrent_callers_plans_are_made_by_the_writer_of_their_batch(registry_and_first):
    registry, first, store = registry_and_first
    writer = FakeAsyncWriter(store)
    *answers, made_while_queued = behind_a_held_batch(
        writer, registry, first, [(f"r-{i}", f"dep-{i}", answer) for i in range(1, 4)],
        before_release=lambda: [e for e in writer.events if e[0] == "made"])
    assert made_while_queued == [("made", "r-0")]    # queued callers' plans are not made by the callers
    assert writer.events == [("made", "r-0"), ("write", ["r-0"]),
                             ("made", "r-1"), ("made", "r-2"), ("made", "r-3"), ("write", ["r-1", "r-2", "r-3"])]
    assert [a[0] for a in answers] == ["new"] * 4
    assert [a[2] for a in answers] == ["r-0", "r-1", "r-2", "r-3"]
    for _, plan_id, rid in answers:                 # what each caller was answered is what was stored
        assert store.plans[plan_id].request.request_id == rid
        assert store.plans[plan_id].request.deployment_id == f"dep-{rid[2:]}"


def test_a_plan_that_cannot_be_made_refuses_its_caller_only_and_is_not_written(registry_and_first):
    registry, first, store = registry_and_first
    writer = FakeAsyncWriter(store)
    ok0, ok1, bad_request, bad_deployment, _ = behind_a_held_batch(
        writer, registry, first, [("r-1", "dep-1", answer), ("bad id", "dep-2", answer), ("r-3", "-dep", answer)])
    assert ok0[2] == "r-0" and ok1[2] == "r-1"
    assert isinstance(bad_request, InvalidArgument) and bad_request.field == "request_id"
    assert isinstance(bad_deployment, InvalidArgument) and bad_deployment.field == "deployment_id"
    assert writer.events[-1] == ("write", ["r-1"])   # the refused ones never reach the store
    assert store.save_calls == ["r-0", "r-1"]


def test_an_answer_that_fails_is_its_callers_error_and_the_plan_stays_saved(registry_and_first):
    registry, first, store = registry_and_first
    writer = FakeAsyncWriter(store)

    def broken(new, plan):
        raise ValueError("cannot encode")

    _, failed, fine, _ = behind_a_held_batch(writer, registry, first, [("r-1", "dep-1", broken),
                                                                        ("r-2", "dep-2", answer)])
    assert writer.events[-1] == ("write", ["r-1", "r-2"])
    assert isinstance(failed, ValueError) and fine[:1] == ("new",) and fine[2] == "r-2"
    # Saved: the caller's retry with its request id is answered with the stored plan.
    assert asyncio.run(writer.save_made(maker(writer, registry, first, "r-1", "dep-1"), answer))[0] == "stored"


def test_a_deferred_plan_is_made_again_for_its_next_batch(registry_and_first):
    registry, first, store = registry_and_first
    writer = FakeAsyncWriter(store, defer={"r-1"})
    kind, plan_id, rid = asyncio.run(writer.save_made(maker(writer, registry, first, "r-1", "dep-1"), answer))
    assert writer.events == [("made", "r-1"), ("write", ["r-1"]), ("made", "r-1"), ("write", ["r-1"])]
    assert (kind, rid) == ("new", "r-1") and store.by_request["r-1"][1] == plan_id


def test_a_stored_plan_is_answered_as_stored(registry_and_first):
    registry, first, store = registry_and_first
    writer = FakeAsyncWriter(store)
    saved = asyncio.run(writer.save_made(maker(writer, registry, first, "r-1", "dep-1"), answer))
    again = asyncio.run(writer.save_made(maker(writer, registry, first, "r-1", "dep-1"), answer))
    assert saved[0] == "new" and again == ("stored", saved[1], "r-1")


def test_a_closed_writer_and_a_timed_out_wait_are_unavailable(registry_and_first):
    registry, first, store = registry_and_first
    writer = FakeAsyncWriter(store, timeout=0.05)

    async def stalled():
        writer.gate = asyncio.Event()                # the database never answers the first batch
        first_call = asyncio.ensure_future(writer.save_made(maker(writer, registry, first, "r-0", "dep-0"), answer))
        await asyncio.sleep(0)
        try:
            return await writer.save_made(maker(writer, registry, first, "r-1", "dep-1"), answer)
        finally:
            first_call.cancel()

    with pytest.raises(Unavailable, match="retry with the same request id"):
        asyncio.run(stalled())
    assert ("made", "r-1") not in writer.events      # withdrawn before any batch took it

    closed = FakeAsyncWriter(FakePlanStore())
    asyncio.run(closed.aclose())
    with pytest.raises(Unavailable, match="shutting down"):
        asyncio.run(closed.save_made(functools.partial(registry.new_plan_like, first, "r-2", "dep-2"), answer))
    assert closed.events == []



def test_an_answer_is_derived_while_its_batch_is_written_and_only_once(registry_and_first):
    registry, first, store = registry_and_first
    writer = FakeAsyncWriter(store)
    derived: list[str] = []

    def recorded(new, plan):
        derived.append(plan.request.request_id)
        return answer(new, plan)

    async def main():
        writer.gate = asyncio.Event()              # the database has the batch and has not committed
        call = asyncio.ensure_future(writer.save_made(maker(writer, registry, first, "r-1", "dep-1"), recorded))
        for _ in range(3):
            await asyncio.sleep(0)
        before_commit = list(derived)
        writer.gate.set()
        return before_commit, await call

    before_commit, got = asyncio.run(main())
    assert writer.events == [("made", "r-1"), ("write", ["r-1"])]
    assert before_commit == ["r-1"] and derived == ["r-1"] and got[0] == "new"


def test_the_fill_wait_is_the_callers_over_accepting_ahead_and_never_negative():
    writer = FakeAsyncWriter(FakePlanStore())
    writer.accepting_ahead()
    writer.fill_wait(0.004)                          # longer than accepting ahead's 1 ms: the caller's wins
    assert writer.group.fill_wait_s == 0.004
    writer.fill_wait(0)
    assert writer.group.fill_wait_s == 0
    for bad in (-0.001, float("nan")):
        with pytest.raises(ValueError, match="fill wait must be >= 0 seconds"):
            writer.fill_wait(bad)
    assert writer.group.fill_wait_s == 0
