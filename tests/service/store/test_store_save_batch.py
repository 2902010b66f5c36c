"""SqlPlanStore.save_batch: the plans of a batch share one transaction, and each still gets the
answer the store gives saving them one by one; concurrent writers (threads, replicas) agree."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa

from loadplan.plan import Decision, LoadPlan, Parallel, Runtime
from loadplan.errors import FailedPrecondition, RegistryError
from loadplan.service.registry import NewPlan, Registry
from loadplan.service.store.db import make_engine, migrate
from loadplan.service.store.group_commit import GroupCommit
from loadplan.service.store.models import DeploymentPinRow, PlanRow
from loadplan.service.store.repository import SqlPlanStore


def new_plan(req) -> NewPlan:
    return Registry(None).new_plan(req)


@pytest.fixture
def reference(db_url, request, tmp_path):
    """A second, empty database of the same kind, saved to one plan at a time: the reference answers."""
    if db_url.startswith("sqlite"):
        url = f"sqlite:///{tmp_path / 'reference.db'}"
    else:
        url = request.getfixturevalue("make_postgres_database")()
    migrate(url)
    engine = make_engine(url)
    yield SqlPlanStore(engine)
    engine.dispose()


def _answer(result):
    """What a caller sees: the plan, or the error's kind, field and message."""
    if isinstance(result, LoadPlan):
        return ("plan", result)
    if isinstance(result, RegistryError):
        return (type(result).__name__, result.field, str(result))
    return (type(result).__name__,)   # a database refusal: its text quotes the statement


def _request(deployment: str, **kw):
    from store_helpers import DEEPSEEK_V3

    from loadplan.plan import ResolveRequest

    base = dict(request_id=f"req-{uuid.uuid4().hex}", deployment_id=deployment, role="target",
                parallel=Parallel(ep_size=8), host="node-0", config=DEEPSEEK_V3, runtime=Runtime(a2a_backend="deepep"))
    base.update(kw)
    return ResolveRequest(**base)


@contextlib.contextmanager
def _statements(engine):
    """The statements `engine` runs meanwhile, each by its first three words."""
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        seen.append(" ".join(statement.split()[:3]))

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)


def _rows(engine, deployments):
    with engine.connect() as conn:
        plans = set(conn.execute(sa.select(PlanRow.plan_id).where(PlanRow.deployment_id.in_(deployments))).scalars())
        pin = DeploymentPinRow
        pins = set(conn.execute(sa.select(pin.deployment_id, pin.role, pin.plan_id, pin.inputs_json)
                                .where(pin.deployment_id.in_(deployments))).all())
    return plans, pins


def test_one_batch_answers_each_caller_like_plans_saved_one_by_one(db_engine, db_url, reference):
    store = SqlPlanStore(db_engine)
    tag = uuid.uuid4().hex[:8]
    a, b, c, d = (f"{name}-{tag}" for name in "abcd")
    none = Runtime(a2a_backend="none")
    # Stored before the batch, in both databases: a's pin, and a request id to reuse.
    pinned_a = new_plan(_request(a, parallel=Parallel(ep_size=8, ep_rank=0)))
    stored_c = new_plan(_request(c))
    for s in (store, reference):
        s.save_plan(pinned_a)
        s.save_plan(stored_c)

    racing_retry = _request(b, parallel=Parallel(ep_size=8, ep_rank=2))
    reused_in_batch = _request(d, request_id=f"dup-{tag}")
    other_time = new_plan(_request(d, parallel=Parallel(ep_size=8, ep_rank=5)))
    earlier = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
    other_time = dataclasses.replace(other_time, plan=dataclasses.replace(other_time.plan, decisions={
        **other_time.plan.decisions, "extra": Decision("extra", 1, "r", "rule", decided_at=earlier)}))
    # ^ a decision decided at another time than its plan: refused
    too_long = new_plan(_request(d, parallel=Parallel(ep_size=8, ep_rank=6)))
    too_long = dataclasses.replace(too_long, plan=dataclasses.replace(
        too_long.plan, request=dataclasses.replace(too_long.plan.request, host="h" * 300)))   # PostgreSQL: VARCHAR(255)
    news = [
        new_plan(_request(a, parallel=Parallel(ep_size=8, ep_rank=1))),                # agrees with a's pin
        new_plan(_request(a, parallel=Parallel(ep_size=8, ep_rank=2), runtime=none)),  # disagrees: refused
        new_plan(dataclasses.replace(pinned_a.plan.request)),                          # a retry: replays
        new_plan(dataclasses.replace(stored_c.plan.request, host="elsewhere")),        # reused id: refused
        new_plan(_request(b, parallel=Parallel(ep_size=8, ep_rank=0))),                # pins b in the batch
        new_plan(_request(b, parallel=Parallel(ep_size=8, ep_rank=1), runtime=none)),  # refused by that pin
        new_plan(racing_retry),
        new_plan(racing_retry),                                                        # same id: replays
        new_plan(reused_in_batch),
        new_plan(dataclasses.replace(reused_in_batch, host="other")),                  # same id: refused
        other_time,
        too_long,
        new_plan(_request(d, parallel=Parallel(ep_size=8, ep_rank=7))),
    ]
    results = store.save_batch(news)
    readers = make_engine(db_url)   # every returned plan is committed: another connection reads it
    try:
        readback = [SqlPlanStore(readers).get_plan(r.plan_id) if isinstance(r, LoadPlan) else None for r in results]
    finally:
        readers.dispose()
    # The reference saves the same plans one at a time, in batch order.
    ref = []
    for new in news:
        try:
            ref.append(reference.save_plan(new))
        except Exception as exc:  # noqa: BLE001
            ref.append(exc)
    assert [_answer(r) for r in results] == [_answer(r) for r in ref]

    # What the answers are (so that a wrong reference cannot hide a wrong store).
    kinds = [_answer(r)[0] for r in results]
    assert kinds[0] == "plan" and not results[0].replayed
    assert kinds[1] == "FailedPrecondition" and results[1].field == "runtime.a2a_backend"
    assert results[2].replayed and results[2].plan_id == pinned_a.plan.plan_id
    assert kinds[3] == "FailedPrecondition" and results[3].field == "request_id"
    assert kinds[4] == "plan" and kinds[5] == "FailedPrecondition" and news[4].plan.plan_id in str(results[5])
    assert {results[6].replayed, results[7].replayed} == {False, True}
    assert results[6].plan_id == results[7].plan_id
    assert kinds[8] == "plan" and kinds[9] == "FailedPrecondition" and results[9].field == "request_id"
    assert kinds[10] == "ValueError"
    assert kinds[11] == ("plan" if db_url.startswith("sqlite") else "DataError")
    assert kinds[12] == "plan"
    # Every returned plan was committed when its caller got it.
    for result, back in zip(results, readback):
        if isinstance(result, LoadPlan):
            assert back == dataclasses.replace(result.dated(), replayed=False)
    # And both databases hold the same rows.
    assert _rows(db_engine, [a, b, c, d]) == _rows(reference.engine, [a, b, c, d])


def test_many_ranks_at_once_pin_once_and_share_commits(busy_store, make_request, rows):
    """The server's group commit over save_batch: 32 ranks at once, one pin, fewer commits than
    ranks, each rank its own plan, `on_commit` told each commit's latency and size."""
    ranks = [make_request(parallel=Parallel(ep_size=32, ep_rank=r), runtime=Runtime(a2a_backend="deepep"))
             for r in range(32)]
    before = rows()
    commits: list[tuple[float, int]] = []

    async def fleet():
        group = GroupCommit(busy_store.save_batch, on_commit=lambda s, n: commits.append((s, n)))
        registry = Registry(busy_store, save=group.save)
        return await asyncio.gather(*(registry.resolve_async(r) for r in ranks))

    plans = asyncio.run(fleet())
    after = rows()
    assert after["plans"] - before["plans"] == 32 and after["deployment_pins"] - before["deployment_pins"] == 1
    assert [p.request.request_id for p in plans] == [r.request_id for r in ranks]
    assert sum(n for _, n in commits) == 32 and len(commits) < 32 and all(s > 0 for s, _ in commits)
    wide = [{k: d.value for k, d in p.decisions.items() if d.deployment_wide} for p in plans]
    assert all(w == wide[0] for w in wide)


@pytest.fixture
def busy_store(db_url):
    engine = make_engine(db_url, pool_size=8, max_overflow=8, pool_timeout=60)
    yield SqlPlanStore(engine)
    engine.dispose()


def test_two_replicas_race_on_one_deployment(db_url, make_request, deployment):
    """Two registry processes on one database: each rank asks both (a retry to another replica);
    a few ranks disagree. One pin; every answer for a request id is the same; rows agree."""
    engines = [make_engine(db_url, pool_size=8, max_overflow=8, pool_timeout=60) for _ in range(2)]
    try:
        replicas = [Registry(SqlPlanStore(e)) for e in engines]
        ranks = [make_request(parallel=Parallel(ep_size=32, ep_rank=r),
                              runtime=Runtime(a2a_backend="none" if r % 8 == 7 else "deepep")) for r in range(32)]
        calls = [(replica, req) for req in ranks for replica in replicas]
        barrier = threading.Barrier(len(calls))

        def one(call):
            replica, req = call
            barrier.wait()
            try:
                return replica.resolve(req)
            except Exception as exc:  # noqa: BLE001
                return exc

        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            results = list(pool.map(one, calls))

        by_request: dict[str, list] = {}
        for (_, req), result in zip(calls, results):
            by_request.setdefault(req.request_id, []).append(result)
        accepted, refused = [], []
        for answers in by_request.values():
            first, second = answers
            if isinstance(first, LoadPlan):
                assert isinstance(second, LoadPlan) and first.plan_id == second.plan_id
                assert sorted([first.replayed, second.replayed]) == [False, True]
                accepted.append(first)
            else:
                assert isinstance(first, FailedPrecondition) and isinstance(second, FailedPrecondition)
                assert first.field == second.field == "runtime.a2a_backend"
                refused.append(first)
        assert len(accepted) + len(refused) == 32 and accepted
        assert len({p.request.runtime.a2a_backend for p in accepted}) == 1

        with engines[0].connect() as conn:
            pins = conn.execute(sa.select(DeploymentPinRow.plan_id).where(
                DeploymentPinRow.deployment_id == deployment)).scalars().all()
            stored = set(conn.execute(sa.select(PlanRow.plan_id).where(
                PlanRow.deployment_id == deployment)).scalars())
        assert len(pins) == 1 and pins[0] in stored
        assert stored == {p.plan_id for p in accepted}
    finally:
        for e in engines:
            e.dispose()


def test_a_replica_checks_a_pin_it_has_not_seen(db_url, make_request, rows):
    """Replica B never saw the pin replica A wrote (no look-up in its cache): it must still refuse a
    disagreeing rank and accept an agreeing one."""
    engines = [make_engine(db_url) for _ in range(2)]
    try:
        a, b = (Registry(SqlPlanStore(e)) for e in engines)
        first = a.resolve(make_request(runtime=Runtime(a2a_backend="deepep"), parallel=Parallel(ep_size=2)))
        before = rows()
        with pytest.raises(FailedPrecondition) as err:
            b.resolve(make_request(runtime=Runtime(a2a_backend="none"), parallel=Parallel(ep_size=2, ep_rank=1)))
        assert err.value.field == "runtime.a2a_backend" and first.plan_id in str(err.value)
        assert rows() == before
        agreeing = b.resolve(make_request(runtime=Runtime(a2a_backend="deepep"),
                                          parallel=Parallel(ep_size=2, ep_rank=1)))
        assert not agreeing.replayed and rows()["deployment_pins"] == before["deployment_pins"]
    finally:
        for e in engines:
            e.dispose()


def test_a_batch_of_a_deployment_the_store_saw_pinned_reads_nothing_before_writing(db_engine, store, make_request):
    """The first try of a batch looks up no request id and no pin this store saw committed: the
    ranks of a pinned deployment are one INSERT of their plans in the transaction. A retry of one
    of them still replays, a disagreeing rank is still refused, and both write nothing."""
    first = store.save_plan(new_plan(make_request(parallel=Parallel(ep_size=4))))
    news = [new_plan(make_request(parallel=Parallel(ep_size=4, ep_rank=r))) for r in (1, 2)]
    with _statements(db_engine) as statements:
        assert [o.plan_id for o in store.save_batch(news)] == [n.plan.plan_id for n in news]
    assert [s for s in statements if not s.startswith("BEGIN")] == ["INSERT INTO plans"]

    disagreeing = new_plan(make_request(parallel=Parallel(ep_size=8, ep_rank=3)))
    retried, refused = store.save_batch([news[0], disagreeing])
    assert retried.replayed and retried.plan_id == news[0].plan.plan_id
    assert isinstance(refused, FailedPrecondition) and refused.field == "parallel.ep_size"
    assert first.plan_id in str(refused)
    with db_engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(PlanRow).where(
            PlanRow.deployment_id == first.request.deployment_id)).scalar_one() == 3


def test_a_batch_that_sets_every_pin_it_inserts_reads_no_pin_back(db_engine, db_url, store, make_request):
    """The pins' INSERT ... ON CONFLICT DO NOTHING counts the rows it inserted: when that is every
    pin of the batch, they are all the batch's and nothing is read back. When another writer set
    one first (a replica whose pin this store never saw), the count falls short: the pins are read
    back, and a plan of the batch that disagrees with that pin is refused, naming it."""
    fresh = [new_plan(make_request(deployment_id=f"fresh-{uuid.uuid4().hex[:8]}")) for _ in range(3)]
    with _statements(db_engine) as statements:
        assert [o.plan_id for o in store.save_batch(fresh)] == [n.plan.plan_id for n in fresh]
    assert [s for s in statements if not s.startswith("BEGIN")] == ["INSERT INTO plans", "INSERT INTO deployment_pins"]
    _, pins = _rows(db_engine, [n.plan.request.deployment_id for n in fresh])
    assert {pin.plan_id for pin in pins} == {n.plan.plan_id for n in fresh}

    other = make_engine(db_url)
    try:
        theirs = SqlPlanStore(other).save_plan(new_plan(make_request(runtime=Runtime(a2a_backend="deepep"))))
    finally:
        other.dispose()
    mine = new_plan(make_request(deployment_id=f"fresh-{uuid.uuid4().hex[:8]}"))
    disagreeing = new_plan(make_request(runtime=Runtime(a2a_backend="none")))
    with _statements(db_engine) as statements:
        saved, refused = store.save_batch([mine, disagreeing])
    assert saved.plan_id == mine.plan.plan_id
    assert isinstance(refused, FailedPrecondition) and refused.field == "runtime.a2a_backend"
    assert theirs.plan_id in str(refused)
    assert "SELECT deployment_pins.deployment_id, deployment_pins.role," in statements
    plans, pins = _rows(db_engine, [theirs.request.deployment_id, mine.plan.request.deployment_id])
    assert plans == {theirs.plan_id, mine.plan.plan_id}
    assert {pin.plan_id for pin in pins} == {theirs.plan_id, mine.plan.plan_id}


def test_every_column_round_trips_in_its_place(store, make_request):
    # Every field its own value, so that two swapped columns cannot pass unnoticed.
    new = new_plan(make_request(quantization_config={"quant_method": "fp8"}, host="host-x"))
    req = dataclasses.replace(new.plan.request, quantization="fp8-explicit", role="speculative",
                              parallel=Parallel(tp_size=11, tp_rank=1, ep_size=12, ep_rank=2, pp_size=13, pp_rank=3,
                                                dp_size=14, dp_rank=4),
                              runtime=Runtime(a2a_backend="deepep", device="cuda:9.0", engine="sglang",
                                              enable_tbo=True, enable_eplb=True, ep_num_redundant_experts=5))
    plan = dataclasses.replace(new.plan, request=req, entry_class="Entry", config_fingerprint="cfp",
                               quantization="fp8-settled", ruleset_version="rs-9")
    saved = store.save_plan(NewPlan(plan, "fingerprint-x", {"k": 1}))
    stored = store.get_plan(saved.plan_id)
    assert stored == plan.dated()
    assert stored.request == req
