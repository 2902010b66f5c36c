"""Database down (issue 6, "Faults, nothing lost"): the registry's link to PostgreSQL is
cut and restored through a proxy while the server keeps running.

While cut: resolves fail UNAVAILABLE (retryable, never INTERNAL/UNKNOWN), health turns
NOT_SERVING. Restored: health SERVING and resolves succeed without a restart; a client
that kept retrying one request id across the outage got exactly one plan; the refused
requests left no row.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from fault_helpers import audit, decision_keys, health, runner_request, wait_for
from loadplan.client import RegistryClient
from loadplan.client.errors import RegistryCallError
from loadplan.service.server import RegistryServer, ServerOptions
from loadplan.service.store.db import make_engine
from loadplan.service.store.repository import SqlPlanStore

# Health follows the store about once a second (ServerOptions' default is what runs in
# production); "within a few seconds" is what a load balancer needs.
HEALTH_WITHIN_S = 5.0


@pytest.fixture
def registry(pg_proxy):
    proxy, url = pg_proxy
    engine = make_engine(url)   # as `loadplan serve` makes it
    server = RegistryServer(SqlPlanStore(engine), ServerOptions(listen="127.0.0.1:0", max_workers=8)).start()
    try:
        yield server, proxy
    finally:
        server.stop(grace=1)
        engine.dispose()


def test_database_down_then_back_without_restart(registry, pg_engine):
    server, proxy = registry
    dep = f"down-{uuid.uuid4().hex[:8]}"
    once = RegistryClient(server.address, timeout=5, max_attempts=1)
    patient = RegistryClient(server.address, timeout=40, max_attempts=200, backoff=0.05, max_backoff=0.25)
    try:
        assert health(server.address) == "SERVING"
        before = once.resolve_load_plan(runner_request(f"{dep}-r0", dep, 0))
        assert not before.replayed

        proxy.cut()
        refused = []
        for rank in (1, 2, 3):
            rid = f"{dep}-refused-{rank}"
            with pytest.raises(RegistryCallError) as info:
                once.resolve_load_plan(runner_request(rid, dep, rank))
            assert info.value.code == "UNAVAILABLE", info.value
            assert "retry" in info.value.message
            refused.append(rid)
        took = wait_for(lambda: health(server.address) == "NOT_SERVING", HEALTH_WITHIN_S, 0.1,
                        "health NOT_SERVING")
        print(f"health NOT_SERVING {took:.2f}s after the cut")

        # A rank that keeps retrying its one request id across the outage.
        got, failed = [], []

        def retrying_rank():
            try:
                got.append(patient.resolve_load_plan(runner_request(f"{dep}-patient", dep, 4)))
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                failed.append(e)

        rank = threading.Thread(target=retrying_rank)
        rank.start()
        time.sleep(1.5)   # several attempts fail while the database is away
        assert not got and not failed
        # Still down: nothing was written by anyone in the meantime.
        assert rank.is_alive()

        proxy.restore()
        took = wait_for(lambda: health(server.address) == "SERVING", HEALTH_WITHIN_S, 0.1, "health SERVING")
        print(f"health SERVING {took:.2f}s after the restore")
        rank.join(timeout=30)
        assert not failed, failed
        assert len(got) == 1

        after = once.resolve_load_plan(runner_request(f"{dep}-r5", dep, 5))
        # The same request again is a replay of the stored plan.
        again = once.resolve_load_plan(runner_request(f"{dep}-patient", dep, 4))
        assert again.replayed and again.plan_id == got[0].plan_id
        assert again.decisions.keys() == got[0].decisions.keys()
        assert all(again.value(k) == got[0].value(k) for k in again.decisions)
    finally:
        once.close()
        patient.close()

    stored = audit(pg_engine, decision_keys(), deployment_prefix=dep)
    assert not set(refused) & stored.plan_of_request.keys(), "a refused request left a plan behind"
    assert stored.request_counts == {f"{dep}-r0": 1, f"{dep}-patient": 1, f"{dep}-r5": 1}
    assert stored.plan_of_request[f"{dep}-patient"] == got[0].plan_id
    assert stored.plan_of_request[f"{dep}-r0"] == before.plan_id
    assert stored.plan_of_request[f"{dep}-r5"] == after.plan_id
    assert list(stored.pins) == [(dep, "target")]


def test_other_calls_are_unavailable_too_while_down(registry):
    """Reads fail UNAVAILABLE as well (a retrying reader waits the outage out)."""
    server, proxy = registry
    with RegistryClient(server.address, timeout=5, max_attempts=1) as c:
        plan = c.resolve_load_plan(runner_request(f"read-{uuid.uuid4().hex[:8]}", f"read-{uuid.uuid4().hex[:8]}", 0))
        proxy.cut()
        for call in (lambda: c.get_plan(plan.plan_id), lambda: c.list_plans(page_size=5)):
            with pytest.raises(RegistryCallError) as info:
                call()
            assert info.value.code == "UNAVAILABLE", info.value
        proxy.restore()
        assert c.get_plan(plan.plan_id).plan_id == plan.plan_id


def test_database_that_stops_answering_is_unavailable_not_a_hang(registry, pg_engine):
    """A partition / a stalled database, not a refused one: only timeouts can tell. The
    registry must still answer UNAVAILABLE (retryable) well within a client's deadline and
    drain itself (NOT_SERVING); when the database answers again, nothing is lost."""
    server, proxy = registry
    dep = f"stall-{uuid.uuid4().hex[:8]}"
    problems = []
    with RegistryClient(server.address, timeout=10, max_attempts=1) as once:
        once.resolve_load_plan(runner_request(f"{dep}-r0", dep, 0))
        proxy.partition()
        try:
            statuses: list[tuple[float, str]] = []

            def watch():
                while time.monotonic() - t0 < HEALTH_WITHIN_S + 1:
                    statuses.append((round(time.monotonic() - t0, 1), health(server.address, 0.5)))
                    time.sleep(0.25)

            t0 = time.monotonic()
            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                once.resolve_load_plan(runner_request(f"{dep}-r1", dep, 1))
                problems.append("a resolve succeeded while the database was partitioned")
            except RegistryCallError as e:
                if e.code != "UNAVAILABLE":
                    problems.append(f"resolve during the partition: {e.code} after "
                                    f"{time.monotonic() - t0:.1f}s, expected UNAVAILABLE")
            watcher.join()
            if not any(s == "NOT_SERVING" for _, s in statuses):
                problems.append(f"health never NOT_SERVING within {HEALTH_WITHIN_S}s: {statuses[-3:]}")
        finally:
            proxy.restore()
        wait_for(lambda: health(server.address) == "SERVING", 10, 0.1, "health SERVING after the partition")
        with RegistryClient(server.address, timeout=20, max_attempts=50, backoff=0.05, max_backoff=0.5) as patient:
            patient.resolve_load_plan(runner_request(f"{dep}-r1", dep, 1))
    audit(pg_engine, decision_keys(), deployment_prefix=dep)
    print("partition problems:", problems, statuses)
    assert not problems, problems


def test_registry_started_while_the_database_is_down(pg_proxy, pg_engine):
    """A replica that starts before its database: NOT_SERVING and UNAVAILABLE, then SERVING
    by itself once the database is reachable (no restart, no manual step)."""
    proxy, url = pg_proxy
    proxy.cut()
    engine = make_engine(url)
    server = RegistryServer(SqlPlanStore(engine), ServerOptions(listen="127.0.0.1:0", max_workers=4)).start()
    dep = f"late-{uuid.uuid4().hex[:8]}"
    try:
        assert health(server.address) == "NOT_SERVING"
        with RegistryClient(server.address, timeout=5, max_attempts=1) as once:
            with pytest.raises(RegistryCallError) as info:
                once.resolve_load_plan(runner_request(f"{dep}-r0", dep, 0))
            assert info.value.code == "UNAVAILABLE", info.value
            proxy.restore()
            wait_for(lambda: health(server.address) == "SERVING", HEALTH_WITHIN_S, 0.1, "health SERVING")
            plan = once.resolve_load_plan(runner_request(f"{dep}-r0", dep, 0))
        assert not plan.replayed   # the refused call had written nothing
    finally:
        server.stop(grace=1)
        engine.dispose()
    assert audit(pg_engine, decision_keys(), deployment_prefix=dep).request_counts == {f"{dep}-r0": 1}
