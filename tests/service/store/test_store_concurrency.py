"""Many ranks at once, and connections lost mid-write (DESIGN 6, 7)."""

from __future__ import annotations

import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from loadplan.plan import Parallel, Runtime
from loadplan.errors import Unavailable
from loadplan.service.registry import Registry
from loadplan.service.store.db import make_engine
from loadplan.service.store.models import DeploymentPinRow
from loadplan.service.store.repository import SqlPlanStore

EP = 32


@pytest.fixture
def busy_engine(db_url):
    # More connections than the default pool so that the writers really overlap.
    engine = make_engine(db_url, pool_size=16, max_overflow=16, pool_timeout=60)
    yield engine
    engine.dispose()


def _resolve_all(registry, requests):
    barrier = threading.Barrier(len(requests))

    def one(req):
        barrier.wait()   # release every rank at once
        return registry.resolve(req)

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        return list(pool.map(one, requests))


def test_all_ranks_at_once_agree_and_pin_once(busy_engine, make_request, deployment):
    from store_helpers import count_rows

    registry = Registry(SqlPlanStore(busy_engine))
    ranks = [make_request(parallel=Parallel(ep_size=EP, ep_rank=r), runtime=Runtime(a2a_backend="deepep"),
                          host=f"node-{r // 8}") for r in range(EP)]
    before = count_rows(busy_engine)

    # Wave 1: every rank twice at the same moment (a client retry racing its first try).
    first = _resolve_all(registry, ranks + ranks)
    by_request: dict[str, set[str]] = {}
    for req, plan in zip(ranks + ranks, first):
        by_request.setdefault(req.request_id, set()).add(plan.plan_id)
    assert all(len(ids) == 1 for ids in by_request.values())   # the racing duplicate got the same plan
    assert sum(not p.replayed for p in first) == EP                 # ...and exactly one of each pair wrote

    # Wave 2: every request id again.
    second = _resolve_all(registry, ranks)
    assert all(p.replayed for p in second)
    assert [p.plan_id for p in second] == [p.plan_id for p in first[:EP]]

    after = count_rows(busy_engine)
    n_decisions = len(first[0].decisions)
    assert after["plans"] - before["plans"] == EP
    assert after["decisions"] == before["decisions"]   # a plan's decisions travel in its row
    assert after["deployment_pins"] - before["deployment_pins"] == 1
    with busy_engine.connect() as conn:
        pins = conn.execute(sa.select(DeploymentPinRow.plan_id).where(
            DeploymentPinRow.deployment_id == deployment)).scalars().all()
    assert len(pins) == 1 and pins[0] in {p.plan_id for p in first}

    stored = [registry.get_plan(p.plan_id) for p in first[:EP]]
    assert all(len(p.decisions) == n_decisions for p in stored)
    wide = [{k: (d.value, d.reason, d.rule) for k, d in p.decisions.items() if d.deployment_wide} for p in stored]
    assert all(w == wide[0] for w in wide)
    assert sorted(p.request.parallel.ep_rank for p in stored) == list(range(EP))


def test_ranks_that_disagree_at_once_never_build_two_layouts(busy_engine, make_request, deployment):
    # Half the ranks ask for deepep, half for the normal path, all at once: whichever
    # rank pins first decides, and every rank of the other half is refused.
    registry = Registry(SqlPlanStore(busy_engine))
    ranks = [make_request(parallel=Parallel(ep_size=EP, ep_rank=r),
                          runtime=Runtime(a2a_backend="deepep" if r % 2 else "none")) for r in range(EP)]
    barrier = threading.Barrier(EP)

    def one(req):
        barrier.wait()
        try:
            return registry.resolve(req)
        except Exception as exc:  # noqa: BLE001
            return exc

    with ThreadPoolExecutor(max_workers=EP) as pool:
        results = list(pool.map(one, ranks))
    plans = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(plans) == EP // 2 and len(refused) == EP // 2
    assert {p.request.runtime.a2a_backend for p in plans} in ({"deepep"}, {"none"})
    assert all(type(e).__name__ == "FailedPrecondition" and "runtime.a2a_backend" in str(e) for e in refused)


# --- a connection lost in the middle of a save ------------------------------------------


def _fail_on_pin_insert(engine, db_url):
    """Make the statement that writes the pin lose its connection, once."""
    fired = []

    @event.listens_for(engine, "before_cursor_execute")
    def lose_connection(conn, cursor, statement, parameters, context, executemany):
        if fired or "INSERT INTO DEPLOYMENT_PINS" not in statement.upper():
            return
        fired.append(statement)
        if engine.dialect.name == "postgresql":
            # Really kill this session's backend from another connection.
            import psycopg

            pid = cursor.connection.info.backend_pid
            url = sa.make_url(db_url).set(drivername="postgresql")
            with psycopg.connect(url.render_as_string(hide_password=False), autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        else:
            raise sqlite3.OperationalError("disk I/O error")

    return fired


def test_connection_lost_mid_save_is_unavailable_and_writes_nothing(db_engine, db_url, make_request):
    engine = db_engine
    from store_helpers import count_rows

    registry = Registry(SqlPlanStore(engine))
    fired = _fail_on_pin_insert(engine, db_url)
    req = make_request()
    before = count_rows(engine)
    with pytest.raises(Unavailable, match="retry with the same request id"):
        registry.resolve(req)
    assert fired
    assert count_rows(engine) == before   # the plan row inserted before the pin is gone too
    # The retry the client makes succeeds on a fresh connection.
    plan = registry.resolve(req)
    assert not plan.replayed
    assert registry.get_plan(plan.plan_id) == plan


def test_concurrent_appends_take_consecutive_revisions(busy_engine, make_request):
    from loadplan.plan import Decision, Keys

    registry = Registry(SqlPlanStore(busy_engine))
    plan = registry.resolve(make_request(runtime=Runtime(enable_eplb=True)))
    n = 12
    calls = [(f"{plan.plan_id}-rebalance-{i % (n // 2)}", i % (n // 2)) for i in range(n)]   # each id twice
    barrier = threading.Barrier(n)

    def one(call):
        request_id, i = call
        barrier.wait()
        return registry.append_decisions(request_id, plan.plan_id, [
            Decision(Keys.EPLB_LAYERS, [i], f"rebalance {i}", "eplb.rebalance", deployment_wide=False)])

    with ThreadPoolExecutor(max_workers=n) as pool:
        results = list(pool.map(one, calls))
    assert sum(not r.replayed for r in results) == n // 2
    history = [d for d in registry.get_plan(plan.plan_id, include_history=True).history if d.key == Keys.EPLB_LAYERS]
    assert sorted(d.revision for d in history) == list(range(n // 2 + 1))
    assert sorted(d.value[0] for d in history if d.revision) == list(range(n // 2))   # each request once
