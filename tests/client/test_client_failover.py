"""One gRPC target for several replicas (`ipv4:a,b`, as the README's operations section says):
when the replica a client was talking to goes away, the next call lands on another."""

from __future__ import annotations

from fake_store import FakePlanStore
from sample_requests import request

from loadplan.client import RegistryClient
from loadplan.service.server import RegistryServer, ServerOptions


def test_ipv4_target_of_two_replicas_fails_over():
    store = FakePlanStore()          # the replicas' shared database
    first = RegistryServer(store, ServerOptions(listen="127.0.0.1:0", max_workers=2)).start()
    second = RegistryServer(store, ServerOptions(listen="127.0.0.1:0", max_workers=2)).start()
    try:
        target = f"ipv4:127.0.0.1:{first.port},127.0.0.1:{second.port}"
        with RegistryClient(target, timeout=5, backoff=0.05) as client:
            before = client.resolve_load_plan(request(deployment_id="failover"))
            first.stop(grace=0)
            after = client.resolve_load_plan(request(deployment_id="failover"))
            again = client.get_plan(before.plan_id)
        assert after.request.deployment_id == "failover" and again == before
        assert store.count() == 2
    finally:
        first.stop(grace=0)
        second.stop(grace=0)
