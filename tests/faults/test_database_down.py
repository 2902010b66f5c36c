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
    engine = make_engine(url, connect_args={"connect_timeout": 3})
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
