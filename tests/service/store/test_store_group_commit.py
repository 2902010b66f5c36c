"""SqlPlanStore's group commit (service/store/group_commit.py): plans saved at the same time share one
transaction, and each caller still gets the answer the store gives saving plans one by one."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa

from loadplan.plan import Decision, LoadPlan, Parallel, Runtime
from loadplan.service.errors import FailedPrecondition, RegistryError
from loadplan.service.registry import NewPlan, Registry
from loadplan.service.store.db import make_engine, migrate
from loadplan.service.store.group_commit import DEFER
from loadplan.service.store.models import DeploymentPinRow, PlanRow
from loadplan.service.store.repository import SqlPlanStore


class _Capture:
    """A PlanStore that keeps nothing: Registry.resolve(req) returns the NewPlan it would save."""

    def save_plan(self, new: NewPlan) -> NewPlan:
        return new


def new_plan(req) -> NewPlan:
    return Registry(_Capture()).resolve(req)


@pytest.fixture
def reference(db_url, request, tmp_path):
    """A second, empty database of the same kind, saved to one plan at a time: the reference answers."""
    if db_url.startswith("sqlite"):
        url = f"sqlite:///{tmp_path / 'reference.db'}"
    else:
        url = request.getfixturevalue("make_postgres_database")()
    migrate(url)
    engine = make_engine(url)
    yield SqlPlanStore(engine, max_batch=1)
    engine.dispose()


def _answer(result):
    """What a caller sees: the plan, or the error's kind, field and message."""
    if isinstance(result, LoadPlan):
        return ("plan", result)
    if isinstance(result, RegistryError):
        return (type(result).__name__, result.field, str(result))
    return (type(result).__name__,)   # a database refusal: its text quotes the statement


def _save_in_one_batch(store: SqlPlanStore, db_url: str, news: list[NewPlan]):
    """Save each of `news` from its own thread, queued in list order while a first batch is held
    back, so that they are written in ONE batch. Each caller reads its plan back at once through a fresh
    engine (a returned plan is committed). Returns (results, readbacks, batches after the first)."""
    real = store._group._write_batch
    holding, release = threading.Event(), threading.Event()
    batches: list[list[tuple[NewPlan, object]]] = []

    def write(items):
        if not batches and not holding.is_set():
            holding.set()
            release.wait(30)
        outcomes = real(items)
        batches.append(list(zip(items, outcomes)))
        return outcomes

    store._group._write_batch = write
    readers = make_engine(db_url)
    results: list = [None] * len(news)
    readback: list = [None] * len(news)

    def one(i: int) -> None:
        try:
            results[i] = store.save_plan(news[i])
        except Exception as exc:  # noqa: BLE001 - the caller's answer
            results[i] = exc
            return
        readback[i] = SqlPlanStore(readers).get_plan(results[i].plan_id)

    plug = new_plan(_request(f"plug-{uuid.uuid4().hex[:8]}"))
    try:
        with ThreadPoolExecutor(max_workers=len(news) + 1) as pool:
            first = pool.submit(store.save_plan, plug)
            assert holding.wait(30)
            futures = []
            for i in range(len(news)):   # one at a time: the batch holds them in list order
                futures.append(pool.submit(one, i))
                deadline = time.monotonic() + 30
                while store._group.pending() < i + 1 and time.monotonic() < deadline:
                    time.sleep(0.002)
            release.set()
            first.result()
            for f in futures:
                f.result()
    finally:
        store._group._write_batch = real
        readers.dispose()
    return results, readback, batches[1:]


def _request(deployment: str, **kw):
    from store_helpers import DEEPSEEK_V3

    from loadplan.plan import ResolveRequest

    base = dict(request_id=f"req-{uuid.uuid4().hex}", deployment_id=deployment, role="target",
                parallel=Parallel(ep_size=8), host="node-0", config=DEEPSEEK_V3, runtime=Runtime(a2a_backend="deepep"))
    base.update(kw)
    return ResolveRequest(**base)


def _rows(engine, deployments):
    with engine.connect() as conn:
        plans = set(conn.execute(sa.select(PlanRow.plan_id).where(PlanRow.deployment_id.in_(deployments))).scalars())
        pin = DeploymentPinRow
        pins = set(conn.execute(sa.select(pin.deployment_id, pin.role, pin.plan_id, pin.inputs_json)
                                .where(pin.deployment_id.in_(deployments))).all())
    return plans, pins


def test_one_batch_answers_each_caller_like_plans_saved_one_by_one(db_engine, db_url, reference):
    store = SqlPlanStore(db_engine, max_batches_in_flight=1)   # one batch at a time: the held one, then ours
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
    no_time = new_plan(_request(d, parallel=Parallel(ep_size=8, ep_rank=5)))
    no_time = dataclasses.replace(no_time, plan=dataclasses.replace(no_time.plan, decisions={
        **no_time.plan.decisions, "extra": Decision("extra", 1, "r", "rule")}))   # no decided_at: refused
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
        new_plan(racing_retry),                                                        # same id: next batch
        new_plan(reused_in_batch),
        new_plan(dataclasses.replace(reused_in_batch, host="other")),                  # same id: next batch
        no_time,
        too_long,
        new_plan(_request(d, parallel=Parallel(ep_size=8, ep_rank=7))),
    ]
    results, readback, batches = _save_in_one_batch(store, db_url, news)

    assert len(batches[0]) == len(news)                     # all of them in one batch...
    deferred = [new for new, outcome in batches[0] if outcome is DEFER]
    assert deferred == [news[7], news[9]]                   # ...but the second call of a request id
    # The reference saves the same plans one at a time, in the order the batches held them.
    ref = {}
    for batch in batches:
        for new, outcome in batch:
            if outcome is not DEFER:
                try:
                    ref[id(new)] = reference.save_plan(new)
                except Exception as exc:  # noqa: BLE001
                    ref[id(new)] = exc
    assert [_answer(r) for r in results] == [_answer(ref[id(n)]) for n in news]

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
            assert back == dataclasses.replace(result, replayed=False)
    # And both databases hold the same rows.
    assert _rows(db_engine, [a, b, c, d]) == _rows(reference.engine, [a, b, c, d])


def test_many_ranks_at_once_pin_once_and_batch(busy_store, make_request, deployment, rows):
    store = busy_store
    ranks = [make_request(parallel=Parallel(ep_size=32, ep_rank=r), runtime=Runtime(a2a_backend="deepep"))
             for r in range(32)]
    before = rows()
    barrier = threading.Barrier(len(ranks))

    def one(req):
        barrier.wait()
        return Registry(store).resolve(req)

    with ThreadPoolExecutor(max_workers=len(ranks)) as pool:
        plans = list(pool.map(one, ranks))
    after = rows()
    assert after["plans"] - before["plans"] == 32 and after["deployment_pins"] - before["deployment_pins"] == 1
    assert store._group.batches < 32    # some ranks shared a commit
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


def test_every_column_round_trips_in_its_place(store, make_request):
    # The batch statements write rows as positional tuples: give every field its own value so
    # that two swapped columns cannot pass unnoticed.
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
    assert stored == plan
    assert stored.request == req
