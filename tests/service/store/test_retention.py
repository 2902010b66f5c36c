"""Pruning the history (service/store/retention.py), on SQLite and on a PostgreSQL database of the test's own
(a prune deletes every old plan of its database: the session's shared one would lose other tests' rows).

Plans are backdated with the registry's clock. What stays: pinned plans (a deployment's first rank) and plans with
a decision revision since the cutoff; what goes: the others created before it, with their revisions and append
records, in whole batches."""

from __future__ import annotations

import datetime as dt
import threading
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from loadplan.plan import Decision, Keys, Parallel, ResolveRequest, Runtime
from loadplan.errors import FailedPrecondition, NotFound
from loadplan.service.registry import Registry
from loadplan.service.store.db import make_engine, migrate
from loadplan.service.store.repository import SqlPlanStore
from loadplan.service.store.retention import prune_plans
from store_helpers import DEEPSEEK_V3, QWEN3, count_rows

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
CUTOFF = T0 + dt.timedelta(days=1)
RECENT = T0 + dt.timedelta(days=2)


class SetClock:
    """The registry's clock, set by the test."""

    def __init__(self, now: dt.datetime):
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'history.db'}"
    else:
        url = request.getfixturevalue("make_postgres_database")()
    migrate(url)
    eng = make_engine(url)
    yield eng
    eng.dispose()


@pytest.fixture
def history(engine):
    return _seed(engine)


def _seed(engine):
    """(registry, clock, plans by name, resolve): deployments A and B pinned by rank 0, B's rank 1 decided on
    since the cutoff, A's rank 1 appended to before it; C resolved after the cutoff."""
    clock = SetClock(T0)
    registry = Registry(SqlPlanStore(engine), clock=clock)

    def resolve(deployment, rank, at, config=DEEPSEEK_V3):
        clock.now = at
        return registry.resolve(ResolveRequest(
            request_id=f"req-{uuid.uuid4().hex}", deployment_id=deployment, role="target",
            parallel=Parallel(ep_size=2, ep_rank=rank), host="node", config=config, quantization_config=None,
            quantization=None, runtime=Runtime(enable_eplb=True)))

    def append(plan, at):
        clock.now = at
        registry.append_decisions(f"append-{uuid.uuid4().hex}", plan.plan_id, [
            Decision(Keys.EPLB_PLACEMENT, [[0, 1]], "rebalanced", "eplb.rebalance", deployment_wide=False)])

    plans = {"a0": resolve("A", 0, T0), "a1": resolve("A", 1, T0 + dt.timedelta(seconds=1)),
             "b0": resolve("B", 0, T0 + dt.timedelta(seconds=2)), "b1": resolve("B", 1, T0 + dt.timedelta(seconds=3)),
             "c0": resolve("C", 0, RECENT), "c1": resolve("C", 1, RECENT)}
    append(plans["a1"], T0 + dt.timedelta(seconds=4))
    append(plans["b1"], RECENT)
    return registry, clock, plans, resolve


def test_prune_keeps_pinned_and_active_plans_and_takes_the_rest_whole(engine, history):
    registry, clock, plans, resolve = history
    before = count_rows(engine)
    dry = prune_plans(engine, CUTOFF, dry_run=True)
    assert (dry.older, dry.kept_pinned, dry.kept_active, dry.pruned, dry.batches) == (4, 2, 1, 1, 0)
    assert count_rows(engine) == before                                  # a dry run deletes nothing

    report = prune_plans(engine, CUTOFF)
    assert (report.older, report.kept_pinned, report.kept_active, report.pruned, report.batches) == (4, 2, 1, 1, 1)
    after = count_rows(engine)
    assert after["plans"] == before["plans"] - 1
    assert after["decision_appends"] == before["decision_appends"] - 1   # a1's append record went with it
    assert after["decisions"] == before["decisions"] - 1                 # ... and its appended revision
    assert after["deployment_pins"] == before["deployment_pins"]
    with pytest.raises(NotFound):
        registry.get_plan(plans["a1"].plan_id)
    for kept in ("a0", "b0", "b1", "c0", "c1"):
        assert registry.get_plan(plans[kept].plan_id).request == plans[kept].request
    assert registry.get_plan(plans["b1"].plan_id).decisions[Keys.EPLB_PLACEMENT].value == [[0, 1]]

    assert prune_plans(engine, CUTOFF).pruned == 0                       # nothing left to prune: idempotent

    # The pins still hold the deployments together: a rank of A with other inputs is refused, the same come in.
    with pytest.raises(FailedPrecondition):
        resolve("A", 1, RECENT, config=QWEN3)
    again = resolve("A", 1, RECENT)
    assert again.decisions[Keys.SHARED_EXPERTS_FUSION].value == plans["a0"].decisions[Keys.SHARED_EXPERTS_FUSION].value


def test_a_pruned_request_id_is_forgotten_a_retry_gets_a_new_plan(engine, history):
    registry, clock, plans, _ = history
    prune_plans(engine, CUTOFF)
    clock.now = RECENT
    retried = registry.resolve(plans["a1"].request)
    assert not retried.replayed and retried.plan_id != plans["a1"].plan_id
    assert retried.request.request_id == plans["a1"].request.request_id


def test_batches_commit_one_by_one_and_a_failed_batch_leaves_its_plans_whole(engine, history):
    registry, clock, plans, resolve = history
    extra = [resolve("A", 1, T0 + dt.timedelta(minutes=m)) for m in range(1, 5)]   # 4 more old ranks of A
    failing = {"on": True}

    @event.listens_for(engine, "before_cursor_execute")
    def fail_deleting_plans(conn, cursor, statement, *args):
        if failing["on"] and statement.lstrip().upper().startswith("DELETE FROM PLANS"):
            raise RuntimeError("disk full")

    before = count_rows(engine)
    with pytest.raises(RuntimeError, match="disk full"):
        prune_plans(engine, CUTOFF, batch_size=2)
    assert count_rows(engine) == before      # the batch's appends and revisions were deleted, then rolled back
    failing["on"] = False

    report = prune_plans(engine, CUTOFF, batch_size=2)
    assert (report.pruned, report.batches) == (5, 3)
    for plan in (plans["a1"], *extra):
        with pytest.raises(NotFound):
            registry.get_plan(plan.plan_id)


def test_refuses_a_naive_cutoff_and_an_empty_batch(engine):
    with pytest.raises(ValueError, match="timezone-aware"):
        prune_plans(engine, dt.datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        prune_plans(engine, CUTOFF, batch_size=0)


@pytest.fixture
def pg_engine(make_postgres_database):
    url = make_postgres_database()
    migrate(url)
    eng = make_engine(url)
    yield eng
    eng.dispose()


def test_on_postgresql_a_plan_locked_by_a_writer_is_left_for_the_next_prune(pg_engine):
    """A prune never waits on a plan another transaction holds (an AppendDecisions being written): it skips it.
    (SQLite has one writer at a time: a prune's batch waits for it.)"""
    engine = pg_engine
    _, _, plans, _ = _seed(engine)
    locked, release = threading.Event(), threading.Event()

    def hold():
        with engine.connect() as conn, conn.begin():
            conn.execute(sa.text("SELECT 1 FROM plans WHERE plan_id = :p FOR UPDATE"), {"p": plans["a1"].plan_id})
            locked.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(30)
        assert prune_plans(engine, CUTOFF).pruned == 0
    finally:
        release.set()
        holder.join()
    assert prune_plans(engine, CUTOFF).pruned == 1
