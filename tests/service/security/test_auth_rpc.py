"""Bearer tokens on a real server: each role against each RPC, refusals before any handler, no token in logs."""

from __future__ import annotations

import logging
import uuid

import grpc
import pytest
from fake_store import FakePlanStore
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sample_requests import request

from loadplan.client import RegistryCallError, RegistryClient
from loadplan.plan import Decision, Runtime
from loadplan.v1 import registry_pb2 as pb
from loadplan.v1 import registry_pb2_grpc as pb_grpc

# The table, written out independently of service/auth.py's METHOD_ROLES.
ALLOWED = {
    "worker": {"ResolveLoadPlan", "RecordObservedPlan", "AppendDecisions", "GetPlan", "ListBackends", "CheckCoverage",
               "CheckCapabilities", "Echo"},
    "reader": {"GetPlan", "ListPlans", "DiffPlans", "CheckUpgrade", "ListBackends", "CheckCoverage",
               "CheckCapabilities", "Echo"},
    "admin": {"ResolveLoadPlan", "RecordObservedPlan", "AppendDecisions", "GetPlan", "ListPlans", "DiffPlans", "CheckUpgrade",
              "ListBackends", "CheckCoverage", "CheckCapabilities", "Echo"},
}
WRITES = {"ResolveLoadPlan", "RecordObservedPlan", "AppendDecisions"}
REFUSALS = {"UNAUTHENTICATED", "PERMISSION_DENIED"}

# One call per RPC; arguments that reach the handler are fine even when it answers NOT_FOUND.
CALLS = {
    "ResolveLoadPlan": lambda c: c.resolve_load_plan(request(deployment_id=f"dep-{uuid.uuid4().hex[:8]}")),
    "AppendDecisions": lambda c: c.append_decisions(uuid.uuid4().hex, "no-such-plan",
                                                    [Decision("eplb.rebalanced", True, "test", "test")]),
    "RecordObservedPlan": lambda c: c.record_observed_plan(
        request(deployment_id=f"dep-{uuid.uuid4().hex[:8]}",
                runtime=Runtime(device="cuda:9.0", engine="sglang", engine_version="0.5.19")),
        [Decision("moe.shared_experts_fusion", False, "observed", "adapter")]),
    "GetPlan": lambda c: c.get_plan("no-such-plan"),
    "ListPlans": lambda c: c.list_plans(page_size=10),
    "DiffPlans": lambda c: c.diff_plans("no-such-plan-a", "no-such-plan-b"),
    "ListBackends": lambda c: c.list_backends(),
    "CheckCoverage": lambda c: c.check_coverage(),
    "CheckUpgrade": lambda c: c.upgrade_check("sglang", "0.5.23"),
    "CheckCapabilities": lambda c: c.check_capabilities(request(deployment_id=f"dep-{uuid.uuid4().hex[:8]}")),
    "Echo": lambda c: c.echo(b"ping"),
}


def outcome(call, client) -> str:
    try:
        call(client)
    except RegistryCallError as e:
        return e.code
    return "OK"


@pytest.fixture
def secured(start_server, token_store):
    store = FakePlanStore()
    return start_server(store, tokens=token_store), store


def connect(server, token, **kw) -> RegistryClient:
    return RegistryClient(server.address, timeout=5.0, max_attempts=1, token=token, **kw)


def test_the_calls_cover_every_rpc():
    assert set(CALLS) == set(pb.DESCRIPTOR.services_by_name["ModelRegistry"].methods_by_name)


@pytest.mark.parametrize("method", sorted(CALLS))
@pytest.mark.parametrize("role", sorted(ALLOWED))
def test_each_role_against_each_rpc(secured, tokens, role, method):
    server, store = secured
    with connect(server, tokens[role]) as client:
        got = outcome(CALLS[method], client)
    if method in ALLOWED[role]:
        assert got not in REFUSALS
        if method == "ResolveLoadPlan":
            assert got == "OK" and store.count() == 1
    else:
        assert got == "PERMISSION_DENIED"
        assert store.save_calls == [] and store.appends == {} and store.count() == 0


@pytest.mark.parametrize("method", sorted(CALLS))
@pytest.mark.parametrize("token", [None, "lp-admin-this-is-not-a-configured-token"], ids=["no-token", "wrong"])
def test_no_or_wrong_token_is_unauthenticated_and_writes_nothing(secured, tokens, token, method):
    server, store = secured
    with connect(server, token if token is not None else "") as client:
        assert outcome(CALLS[method], client) == "UNAUTHENTICATED"
    assert store.save_calls == [] and store.appends == {}
    with connect(server, tokens["admin"]) as admin:       # what an operator sees: no plan at all
        assert admin.list_plans()[0] == []


def test_a_refused_resolve_never_reaches_the_handler_even_with_an_undecodable_body(secured, tokens):
    server, store = secured
    with grpc.insecure_channel(server.address) as ch:
        raw = ch.unary_unary("/loadplan.v1.ModelRegistry/ResolveLoadPlan")   # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\xff not a protobuf", timeout=5, metadata=(("authorization", f"Bearer {tokens['reader']}"),))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "role 'reader' may not call ResolveLoadPlan" in info.value.details()
    assert store.save_calls == []


@pytest.mark.parametrize("metadata", [
    (("authorization", "Basic dXNlcjpwYXNz"),),
    (("authorization", "Bearer"),),
    (("authorization", "Bearer a"), ("authorization", "Bearer b")),
], ids=["basic", "bearer-without-token", "two-headers"])
def test_malformed_authorization_is_unauthenticated(secured, metadata):
    server, _ = secured
    with grpc.insecure_channel(server.address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.ModelRegistryStub(ch).Echo(pb.EchoRequest(payload=b"x"), timeout=5, metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_scheme_is_case_insensitive(secured, tokens):
    server, _ = secured
    with grpc.insecure_channel(server.address) as ch:
        reply = pb_grpc.ModelRegistryStub(ch).Echo(pb.EchoRequest(payload=b"x"), timeout=5,
                                                   metadata=(("authorization", f"bearer {tokens['reader']}"),))
    assert reply.payload == b"x"


def test_health_and_reflection_need_no_token(secured):
    server, _ = secured
    with grpc.insecure_channel(server.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="loadplan.v1.ModelRegistry"), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "loadplan.v1.ModelRegistry" in names


def test_token_from_the_environment(secured, tokens, monkeypatch):
    server, store = secured
    monkeypatch.setenv("LOADPLAN_TOKEN", tokens["worker"])
    with RegistryClient(server.address, timeout=5.0, max_attempts=1) as client:
        client.resolve_load_plan(request())
    monkeypatch.setenv("LOADPLAN_TOKEN", tokens["reader"])
    with RegistryClient(server.address, timeout=5.0, max_attempts=1) as client:
        assert outcome(CALLS["ResolveLoadPlan"], client) == "PERMISSION_DENIED"
    with RegistryClient(server.address, timeout=5.0, max_attempts=1, token="") as client:   # "" overrides the env
        assert outcome(CALLS["Echo"], client) == "UNAUTHENTICATED"
    assert store.count() == 1


def auth_lines(caplog, level):
    return [r for r in caplog.records if r.name == "loadplan.service.auth" and r.levelno == level]


def test_open_server_on_a_network_address_warns_once(start_server, caplog):
    caplog.set_level(logging.INFO, logger="loadplan.service.auth")
    server = start_server(listen="0.0.0.0:0")
    warnings = auth_lines(caplog, logging.WARNING)
    assert len(warnings) == 1 and "authentication off" in warnings[0].getMessage()
    with RegistryClient(f"127.0.0.1:{server.port}", timeout=5.0, token="") as client:   # and it is open
        assert client.echo(b"hi") == b"hi"


def test_open_loopback_and_secured_servers_do_not_warn(start_server, token_store, caplog):
    caplog.set_level(logging.INFO, logger="loadplan.service.auth")
    start_server()                          # the embedded registry's case
    start_server(listen="0.0.0.0:0", tokens=token_store)
    assert auth_lines(caplog, logging.WARNING) == []
    infos = [r.getMessage() for r in auth_lines(caplog, logging.INFO)]
    assert len(infos) == 2 and "authentication on: bearer tokens (1 worker, 1 reader, 1 admin)" in infos


class ExplodingStore(FakePlanStore):
    def save_plan(self, new):
        raise RuntimeError("disk on fire")


def test_tokens_never_reach_the_logs(start_server, token_store, tokens, caplog):
    caplog.set_level(logging.DEBUG)             # every logger, server and client side
    server = start_server(ExplodingStore(), tokens=token_store)
    wrong = "lp-worker-" + "q" * 32
    for token in (tokens["worker"], tokens["reader"], tokens["admin"], wrong, ""):
        with connect(server, token) as client:
            for call in CALLS.values():
                outcome(call, client)           # successes, INTERNAL (with a traceback), refusals
    text = caplog.text + " ".join(repr(r.args) for r in caplog.records)
    assert "incident" in text and "refused" in text     # the failure paths did log
    for secret in (*tokens.values(), wrong):
        assert secret not in text
