"""`PgAsyncWriter` (service/store/pg_async_writer.py): new plans written to PostgreSQL from an
event loop, with `SqlPlanStore.save_plan`'s contract (service/registry.py `PlanStore.save_plan`).

Each test runs its own loop (`asyncio.run`), creates the writer in it the way the server does
(`store.async_writer(executor)`) and closes it with `aclose()`. Outcomes are checked in the
database through an engine of their own, never through the writer's connections. Batches are
held up by taking a lock on `plans` from another connection in a `before_statement` hook: the
writer's statement then really waits on the server, as it would behind a stalled database.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy import event

from loadplan.plan import Parallel, Runtime
from loadplan.service.errors import FailedPrecondition, Unavailable
from loadplan.service.registry import Registry
from loadplan.service.store import pg_async_writer, pq_statement
from loadplan.service.store.db import make_engine, psycopg_connect_kwargs
from loadplan.service.store.pg_async_writer import PgAsyncWriter
from loadplan.service.store.repository import SqlPlanStore

# Nothing listens on port 1 of this machine: a connection is refused at once.
UNREACHABLE_URL = "postgresql+psycopg://postgres@127.0.0.1:1/postgres"


@pytest.fixture
def engine(postgres_url):
    eng = make_engine(postgres_url)
    yield eng
    eng.dispose()


@pytest.fixture
def store(engine) -> SqlPlanStore:
    # PostgreSQL only (the store conftest's `store` runs on both databases).
    return SqlPlanStore(engine)


@pytest.fixture
def executor():
    # The careful path's transactions run here, as on the server's worker threads.
    pool = ThreadPoolExecutor(max_workers=4)
    yield pool
    pool.shutdown(wait=True)


@pytest.fixture
def observer(postgres_url):
    """An engine of its own: what it reads is committed, whatever the writer's connections hold."""
    eng = make_engine(postgres_url)
    yield eng
    eng.dispose()


class TableLock:
    """`LOCK TABLE plans IN ACCESS EXCLUSIVE MODE` in an open transaction of another connection:
    every statement touching `plans` waits until `release()`."""

    def __init__(self, engine):
        self._conn = psycopg.connect(**psycopg_connect_kwargs(engine))
        self.held = False

    def take(self) -> None:
        self._conn.execute("SET lock_timeout = '5s'")   # never hang the test on somebody else's lock
        self._conn.execute("LOCK TABLE plans IN ACCESS EXCLUSIVE MODE")
        self.held = True

    def release(self) -> None:
        if self.held:
            self._conn.rollback()
            self.held = False

    def close(self) -> None:
        self.release()
        self._conn.close()


@pytest.fixture
def table_lock(engine):
    lock = TableLock(engine)
    yield lock
    lock.close()


def run_writer(store: SqlPlanStore, executor, body, **options):
    """asyncio.run(body(writer)) with a writer made in that loop (`options` for it) and closed after."""

    async def main():
        writer = store.async_writer(executor, **options)
        try:
            return await body(writer)
        finally:
            await writer.aclose()

    return asyncio.run(main())


def new_plan(store: SqlPlanStore, request):
    """The NewPlan the registry hands its store for `request` (a fresh plan id each call)."""
    return Registry(store).new_plan(request)


def plan_rows(engine, *, request_id: str | None = None, deployment_id: str | None = None) -> list[str]:
    """Plan ids stored for a request id or a deployment."""
    column, value = ("request_id", request_id) if request_id is not None else ("deployment_id", deployment_id)
    with engine.connect() as conn:
        return conn.execute(sa.text(f"SELECT plan_id FROM plans WHERE {column} = :v ORDER BY plan_id"),
                            {"v": value}).scalars().all()


def pins(engine, deployment_ids) -> dict[tuple[str, str], list[str]]:
    """(deployment, role) -> the plan ids of its pin rows."""
    out: dict[tuple[str, str], list[str]] = {}
    with engine.connect() as conn:
        for dep, role, plan_id in conn.execute(
                sa.text("SELECT deployment_id, role, plan_id FROM deployment_pins "
                        "WHERE deployment_id = ANY(:d)"), {"d": list(deployment_ids)}):
            out.setdefault((dep, role), []).append(plan_id)
    return out


# --- which databases -------------------------------------------------------------------------


def test_sqlite_stores_get_no_pg_async_writer(sqlite_url):
    engine = make_engine(sqlite_url)
    try:
        sqlite_store = SqlPlanStore(engine)
        assert not isinstance(sqlite_store.async_writer(), PgAsyncWriter)
        with pytest.raises(ValueError, match="PostgreSQL"):
            PgAsyncWriter(sqlite_store)
    finally:
        engine.dispose()


# --- what a save answers and writes ------------------------------------------------------------


def test_a_save_returns_its_plan_committed(store, executor, observer, make_request):
    request = make_request(parallel=Parallel(ep_size=2, ep_rank=0))
    new = new_plan(store, request)

    async def body(writer):
        plan = await writer.save(new)
        # Committed when the await returns: another engine reads it at once.
        stored = SqlPlanStore(observer).get_plan(plan.plan_id)
        return writer, plan, stored

    writer, plan, stored = run_writer(store, executor, body)
    assert plan.plan_id == new.plan.plan_id and not plan.replayed
    assert stored.request == new.plan.request   # as decided: the engine named
    assert stored.decisions == plan.decisions
    assert (writer.group.batches, writer.group.items) == (1, 1)
    assert pins(observer, [request.deployment_id]) == {(request.deployment_id, "target"): [plan.plan_id]}


def test_a_lone_save_yields_to_the_loop_only_once_its_statement_is_sent(store, executor, make_request, deployment,
                                                                       monkeypatch):
    """What is scheduled on the loop before a lone caller's save (the writer's: the answers of its
    made plans, async_writer._answer_early) runs while the database works on the plan, not before
    the statement goes out nor after the commit."""
    events = []
    read_results = pq_statement._results

    def results(pgconn):
        events.append("sent")        # what the statement sent, flushed and read from here on
        return read_results(pgconn)

    def rank(deployment: str, r: int):
        return new_plan(store, make_request(deployment_id=deployment, parallel=Parallel(ep_size=4, ep_rank=r)))

    async def body(writer):
        # Connects and prepares both statements: a deployment's first rank pins it, the next ranks
        # are checked against the pin the store remembers.
        for r in range(2):
            await writer.save(rank(f"{deployment}-a", r))
        writer.before_statement.append(lambda conn, sql: events.append("statement"))
        monkeypatch.setattr(pq_statement, "_results", results)
        for new in (rank(f"{deployment}-b", 0), rank(f"{deployment}-a", 2)):
            asyncio.get_running_loop().call_soon(events.append, "callback")
            await writer.save(new)
            events.append("saved")

    run_writer(store, executor, body)
    assert events == ["statement", "sent", "callback", "saved"] * 2


def test_concurrent_saves_are_group_committed_each_plan_once(store, executor, observer, make_request,
                                                             deployment):
    deployments = [f"{deployment}-{d}" for d in range(5)]
    requests = [make_request(deployment_id=dep, role=role, parallel=Parallel(ep_size=8, ep_rank=rank),
                             host=f"node-{rank}")
                for dep in deployments for role in ("target", "speculative") for rank in range(5)]
    news = [new_plan(store, r) for r in requests]

    async def body(writer):
        return writer, await asyncio.gather(*(writer.save(n) for n in news))

    writer, plans = run_writer(store, executor, body)
    assert len(plans) == 50
    assert writer.group.batches < len(news)                 # grouped: fewer batches than plans
    assert writer.group.items == len(news)
    assert [p.plan_id for p in plans] == [n.plan.plan_id for n in news]   # each caller its own plan
    assert not any(p.replayed for p in plans)
    for dep in deployments:
        stored = plan_rows(observer, deployment_id=dep)
        assert sorted(stored) == sorted(p.plan_id for p in plans if p.request.deployment_id == dep)
    pinned = pins(observer, deployments)
    assert set(pinned) == {(dep, role) for dep in deployments for role in ("target", "speculative")}
    by_group = {}
    for p in plans:
        by_group.setdefault((p.request.deployment_id, p.request.role), set()).add(p.plan_id)
    for group, ids in pinned.items():
        assert len(ids) == 1 and ids[0] in by_group[group]   # one pin, set by a plan of its group


def test_the_same_request_id_twice_at_once_replays_in_a_later_batch(store, executor, observer, make_request):
    request = make_request()
    first, again = new_plan(store, request), new_plan(store, request)

    async def body(writer):
        return writer, await asyncio.gather(writer.save(first), writer.save(again))

    writer, (plan, replay) = run_writer(store, executor, body)
    assert plan.plan_id == first.plan.plan_id and not plan.replayed
    assert replay.replayed and replay.plan_id == first.plan.plan_id
    assert writer.group.batches == 2                          # the second waited for the first's commit
    assert plan_rows(observer, request_id=request.request_id) == [first.plan.plan_id]


def test_a_stored_request_id_replays_the_same_request_and_refuses_another(store, executor, observer,
                                                                         make_request, deployment):
    request = make_request()
    first = new_plan(store, request)
    other = new_plan(store, make_request(request_id=request.request_id, host="elsewhere"))
    same = new_plan(store, request)

    async def body(writer):
        plan = await writer.save(first)
        with pytest.raises(FailedPrecondition, match="request_id") as refused:
            await writer.save(other)
        replay = await writer.save(same)
        return plan, refused.value, replay

    plan, refused, replay = run_writer(store, executor, body)
    assert refused.field == "request_id" and plan.plan_id in str(refused)
    assert replay.replayed and replay.plan_id == plan.plan_id
    assert plan_rows(observer, request_id=request.request_id) == [plan.plan_id]
    assert plan_rows(observer, deployment_id=deployment) == [plan.plan_id]


def test_a_rank_that_disagrees_with_the_pin_is_refused_alone(store, executor, observer, make_request,
                                                             deployment):
    def rank(r: int, backend: str = "deepep"):
        return make_request(parallel=Parallel(ep_size=4, ep_rank=r), runtime=Runtime(a2a_backend=backend))

    news = [new_plan(store, rank(0)), new_plan(store, rank(1)), new_plan(store, rank(2, backend="none")),
            new_plan(store, rank(3))]

    async def body(writer):
        return await asyncio.gather(*(writer.save(n) for n in news), return_exceptions=True)

    outcomes = run_writer(store, executor, body)
    refused = outcomes[2]
    assert isinstance(refused, FailedPrecondition), refused
    assert refused.field == "runtime.a2a_backend"
    assert [o.plan_id for k, o in enumerate(outcomes) if k != 2] == [n.plan.plan_id for k, n in enumerate(news)
                                                                      if k != 2]
    assert plan_rows(observer, request_id=news[2].plan.request.request_id) == []
    assert plan_rows(observer, deployment_id=deployment) == sorted(n.plan.plan_id for k, n in enumerate(news)
                                                                   if k != 2)
    assert pins(observer, [deployment]) == {(deployment, "target"): [news[0].plan.plan_id]}


def test_a_pin_set_by_another_replica_decides_carefully(store, engine, executor, observer, postgres_url,
                                                        make_request, deployment):
    def rank(r: int, backend: str = "deepep"):
        return make_request(parallel=Parallel(ep_size=4, ep_rank=r), runtime=Runtime(a2a_backend=backend))

    replica = make_engine(postgres_url)
    try:
        pinned = SqlPlanStore(replica).save_plan(new_plan(store, rank(0)))
    finally:
        replica.dispose()
    agrees, disagrees = new_plan(store, rank(1)), new_plan(store, rank(2, backend="none"))
    # The writer's own statements go through its hook; the careful path's through the store's engine.
    optimistic: list[str] = []
    careful: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda conn, cursor, statement, *rest: careful.append(statement))

    async def body(writer):
        writer.before_statement.append(lambda conn, sql: optimistic.append(sql))
        return await asyncio.gather(writer.save(agrees), writer.save(disagrees), return_exceptions=True)

    agreed, refused = run_writer(store, executor, body)
    # Tried optimistically as the pin's setter (the other replica's pin unknown here), then decided
    # by the careful path, which looked the stored pin up.
    assert [s.split("(")[0].strip() for s in optimistic] == ["WITH new_pins AS"], optimistic
    assert any("FROM deployment_pins" in s for s in careful), careful
    assert agreed.plan_id == agrees.plan.plan_id and not agreed.replayed
    assert isinstance(refused, FailedPrecondition) and refused.field == "runtime.a2a_backend"
    assert pinned.plan_id in str(refused)                     # refused against the other replica's pin
    assert plan_rows(observer, deployment_id=deployment) == sorted([pinned.plan_id, agreed.plan_id])
    assert pins(observer, [deployment]) == {(deployment, "target"): [pinned.plan_id]}


# --- a database that fails, stalls or restarts ------------------------------------------------


def test_an_unreachable_database_is_unavailable_at_once(executor, make_request):
    unreachable = make_engine(UNREACHABLE_URL)
    try:
        store = SqlPlanStore(unreachable)
        news = [new_plan(store, make_request()) for _ in range(2)]

        async def body(writer):
            for new in news:   # the second proves the first left the writer usable
                started = time.monotonic()
                with pytest.raises(Unavailable, match="retry with the same request id"):
                    await writer.save(new)
                assert time.monotonic() - started < 3
                assert writer.group.leaders() == 0 and writer.group.pending() == 0
                assert writer._idle == []                     # no connection was kept

        run_writer(store, executor, body)
    finally:
        unreachable.dispose()


def test_a_connection_terminated_while_idle_is_replaced_before_use(store, executor, observer, make_request,
                                                                   monkeypatch, deployment):
    first, second = new_plan(store, make_request()), new_plan(store, make_request())

    async def body(writer):
        await writer.save(first)
        [(idle, _)] = writer._idle
        killed = idle.info.backend_pid
        with observer.connect() as conn:
            # Waits (up to 5 s) until that backend is gone, as after a database restart.
            assert conn.execute(sa.text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": killed}).scalar()
        # Idle "long enough" without sleeping: every idle connection is pinged before use.
        monkeypatch.setattr(pg_async_writer, "PING_IF_IDLE_S", 0)
        plan = await writer.save(second)                      # no error reaches the caller
        [(replacement, _)] = writer._idle
        return plan, killed, replacement.info.backend_pid

    plan, killed, now = run_writer(store, executor, body)
    assert plan.plan_id == second.plan.plan_id
    assert now != killed
    assert plan_rows(observer, deployment_id=deployment) == sorted([first.plan.plan_id, second.plan.plan_id])


def test_a_statement_that_stalls_is_cut_unavailable(postgres_url, executor, observer, make_request, deployment):
    engine = make_engine(postgres_url, operation_timeout_s=0.5)
    lock = TableLock(engine)
    try:
        store = SqlPlanStore(engine)
        request = make_request()
        stalled, retried = new_plan(store, request), new_plan(store, request)

        def lock_plans(conn, sql):
            if not lock.held:
                lock.take()

        async def body(writer):
            writer.before_statement.append(lock_plans)
            started = time.monotonic()
            with pytest.raises(Unavailable):
                await writer.save(stalled)
            took = time.monotonic() - started
            lock.release()
            writer.before_statement.clear()
            # The retry with the same request id is written: the writer recovered.
            return took, await writer.save(retried)

        took, plan = run_writer(store, executor, body)
        assert took < 2, took
        assert plan.plan_id == retried.plan.plan_id and not plan.replayed   # the stalled one wrote nothing
        assert plan_rows(observer, deployment_id=deployment) == [retried.plan.plan_id]
    finally:
        lock.close()
        engine.dispose()


# --- closing, and callers that stop waiting -----------------------------------------------------


def test_aclose_waits_for_the_batch_in_flight_then_refuses(store, executor, observer, make_request, table_lock):
    in_flight = new_plan(store, make_request())
    late = new_plan(store, make_request())

    async def body(writer):
        entered = asyncio.Event()
        used = []

        def hold(conn, sql):
            if not table_lock.held:
                table_lock.take()
            used.append(conn)
            entered.set()

        writer.before_statement.append(hold)
        saving = asyncio.create_task(writer.save(in_flight))
        await entered.wait()
        closing = asyncio.create_task(writer.aclose())
        for _ in range(20):
            await asyncio.sleep(0)                            # let aclose run as far as it can
        assert not closing.done() and not saving.done()      # the statement waits on the lock
        table_lock.release()
        await closing
        assert saving.done()
        with pytest.raises(Unavailable, match="shutting down"):
            await writer.save(late)
        assert all(conn.closed for conn in used)              # its connection was closed
        return saving.result()

    plan = run_writer(store, executor, body)
    assert plan.plan_id == in_flight.plan.plan_id
    assert plan_rows(observer, request_id=in_flight.plan.request.request_id) == [in_flight.plan.plan_id]
    assert plan_rows(observer, request_id=late.plan.request.request_id) == []


def test_callers_stop_waiting_and_say_whether_their_plan_may_commit(postgres_url, executor, observer,
                                                                    make_request, deployment):
    """A lone caller writes its own batch (bounded by its statement alone); callers that queue
    behind it share the next batch. Held by a table lock, a queued caller whose batch has not
    started gives up "not written"; callers whose shared batch hangs give up "may commit"."""
    # A large operation timeout: only the callers' wait (1 s: room for the lone statement before the
    # shared batch, should the database be slow a moment) ends the waits below.
    engine = make_engine(postgres_url, operation_timeout_s=10)
    lock = TableLock(engine)
    try:
        store = SqlPlanStore(engine, wait_timeout_s=1.0)
        # Deployments of their own: no batch waits for another's pin.
        alone, queued, shared_a, shared_b = (new_plan(store, make_request(deployment_id=f"{deployment}-{x}"))
                                             for x in "abcd")

        async def body(writer):
            assert writer.group.max_leaders == 1
            statements = []
            sent = [asyncio.Event() for _ in range(3)]

            def hold(conn, sql):
                # Statements 1 (the lone caller's) and 3 (the shared batch's) take the table lock.
                statements.append(sql)
                if len(statements) in (1, 3) and not lock.held:
                    lock.take()
                sent[len(statements) - 1].set()

            writer.before_statement.append(hold)
            # 1. The lone caller's statement is held; a caller queued behind it gives up unwritten.
            first = asyncio.create_task(writer.save(alone))
            await sent[0].wait()
            started = time.monotonic()
            withdrawn = await asyncio.gather(writer.save(queued), return_exceptions=True)
            waited = time.monotonic() - started
            queue_after = writer.group.pending()
            lock.release()
            plan = await first                                # bounded by its own statement: written
            # 2. Two callers queued behind a lone one share the next batch, which is held. The lone
            # statement waits for the lock while they queue (else, answered before they come, it
            # would leave them nobody to queue behind).
            lone = new_plan(store, make_request(deployment_id=f"{deployment}-e"))
            lock.take()
            saves = [asyncio.create_task(writer.save(lone))]
            await sent[1].wait()
            saves += [asyncio.create_task(writer.save(x)) for x in (shared_a, shared_b)]
            while writer.group.pending() < 2:
                await asyncio.sleep(0.01)
            lock.release()                                    # the lone one commits; [a, b] is taken
            outcomes = await asyncio.gather(*saves, return_exceptions=True)
            lock.release()
            return plan, withdrawn[0], waited, queue_after, outcomes

        plan, withdrawn, waited, queue_after, outcomes = run_writer(store, executor, body)
        assert plan.plan_id == alone.plan.plan_id
        assert isinstance(withdrawn, Unavailable) and "not written" in str(withdrawn), withdrawn
        assert 0.95 <= waited < 3, waited
        assert queue_after == 0                               # withdrawn from the queue
        lone_plan, *shared = outcomes
        assert not isinstance(lone_plan, BaseException), lone_plan
        assert all(isinstance(o, Unavailable) and "may commit" in str(o) for o in shared), shared
        # aclose waited for the shared batch: it committed although its callers gave up.
        for new in (alone, shared_a, shared_b):
            assert plan_rows(observer, request_id=new.plan.request.request_id) == [new.plan.plan_id]
        assert plan_rows(observer, request_id=queued.plan.request.request_id) == []
    finally:
        lock.close()
        engine.dispose()
