"""Server wiring: health follows store readiness, reflection, limits, start-up refusal."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from fake_store import FakePlanStore
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sample_requests import deepseek_config, request

from loadplan.client import RegistryClient
from loadplan.client.convert import request_to_pb
from loadplan.service import reflection_v1
from loadplan.service.rules import entries
from loadplan.service.server import SERVICE_NAME, RegistryServer, ServerOptions, ServerStartError
from loadplan.v1 import registry_pb2 as pb
from loadplan.v1 import registry_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_of(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_for(address: str, want: int, timeout: float = 3.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        got = health_of(address, SERVICE_NAME)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def test_health_follows_store_readiness():
    store = FakePlanStore(ready=False)
    with RegistryServer(store, ServerOptions(listen="127.0.0.1:0", readiness_interval_s=0.05)) as srv:
        assert SERVICE_NAME == "loadplan.v1.ModelRegistry"
        assert health_of(srv.address, SERVICE_NAME) == NOT_SERVING
        assert health_of(srv.address, "") == NOT_SERVING
        store.is_ready = True
        assert wait_for(srv.address, SERVING) == SERVING
        assert health_of(srv.address, "") == SERVING
        store.is_ready = False          # the database went away
        assert wait_for(srv.address, NOT_SERVING) == NOT_SERVING
        store.is_ready = True           # and came back
        assert wait_for(srv.address, SERVING) == SERVING


def test_a_readiness_check_that_raises_means_not_serving():
    class Broken(FakePlanStore):
        def ready(self):
            raise OSError("connection refused")

    with RegistryServer(Broken(), ServerOptions(listen="127.0.0.1:0", readiness_interval_s=0.05)) as srv:
        assert health_of(srv.address, SERVICE_NAME) == NOT_SERVING


def test_stop_reports_not_serving_and_refuses_calls():
    srv = RegistryServer(FakePlanStore(), ServerOptions(listen="127.0.0.1:0")).start()
    address = srv.address
    assert health_of(address, SERVICE_NAME) == SERVING
    srv.stop(grace=0.2)
    with RegistryClient(address, timeout=1, max_attempts=1) as client, pytest.raises(Exception) as info:
        client.echo(b"x")
    assert getattr(info.value, "code", None) == "UNAVAILABLE"


def test_reflection_lists_the_services(server):
    with grpc.insecure_channel(server.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=5)
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"loadplan.v1.ModelRegistry", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_answers_under_v1_and_v1alpha(server, version):
    """grpcurl and Postman ask grpc.reflection.v1 first; older clients v1alpha. Both list the
    services and hand out the registry's file descriptor."""
    if version == "v1":
        req_cls, resp_cls = (reflection_v1.v1_message("ServerReflectionRequest"),
                             reflection_v1.v1_message("ServerReflectionResponse"))
        method = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
    else:
        req_cls, resp_cls = reflection_pb2.ServerReflectionRequest, reflection_pb2.ServerReflectionResponse
        method = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    with grpc.insecure_channel(server.address) as ch:
        call = ch.stream_stream(method, request_serializer=req_cls.SerializeToString,
                                response_deserializer=resp_cls.FromString)
        replies = list(call(iter([req_cls(list_services=""),
                                  req_cls(file_containing_symbol="loadplan.v1.ModelRegistry")]), timeout=5))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"loadplan.v1.ModelRegistry", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in replies[1].file_descriptor_response.file_descriptor_proto]
    assert any(f.package == "loadplan.v1" and "ModelRegistry" in {s.name for s in f.service} for f in files)


def test_reflection_v1_describes_itself(server):
    req_cls = reflection_v1.v1_message("ServerReflectionRequest")
    resp_cls = reflection_v1.v1_message("ServerReflectionResponse")
    with grpc.insecure_channel(server.address) as ch:
        call = ch.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                request_serializer=req_cls.SerializeToString, response_deserializer=resp_cls.FromString)
        (reply,) = list(call(iter([req_cls(file_containing_symbol="grpc.reflection.v1.ServerReflection")]),
                             timeout=5))
    assert not reply.HasField("error_response"), reply.error_response
    (fd,) = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in reply.file_descriptor_response.file_descriptor_proto]
    assert fd.package == "grpc.reflection.v1" and fd.service[0].name == "ServerReflection"


def test_message_size_limit_is_configurable():
    store = FakePlanStore()
    opts = ServerOptions(listen="127.0.0.1:0", max_receive_message_bytes=64 * 1024)
    with RegistryServer(store, opts) as srv, grpc.insecure_channel(srv.address) as ch:
        from loadplan.v1 import registry_pb2_grpc as pb_grpc

        stub = pb_grpc.ModelRegistryStub(ch)
        stub.ResolveLoadPlan(request_to_pb(request(deepseek_config(padding="x" * 30_000))), timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            stub.ResolveLoadPlan(request_to_pb(request(deepseek_config(padding="x" * 100_000))), timeout=5)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert store.count() == 1


class HoldsTheLoop(grpc.aio.ServerInterceptor):
    """Holds the server's event loop (a blocking sleep, on purpose) in the first call it sees: the
    calls that arrive meanwhile wait in gRPC for the server to take them up, as in a fleet start."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.holding = threading.Event()

    async def intercept_service(self, continuation, details):
        if not self.holding.is_set():
            self.holding.set()
            time.sleep(self.seconds)
        return await continuation(details)


def codes_of_calls_that_wait(n: int, **options) -> list[grpc.StatusCode]:
    """The statuses of `n` Echo calls that arrive while the server's loop is held for a second."""
    hold = HoldsTheLoop(1.0)
    opts = ServerOptions(listen="127.0.0.1:0", interceptors=(hold,), **options)
    with RegistryServer(FakePlanStore(), opts) as srv, grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.ModelRegistryStub(ch)
        first = stub.Echo.future(pb.EchoRequest(payload=b"first"), timeout=30)
        assert hold.holding.wait(10)
        waiting = [stub.Echo.future(pb.EchoRequest(payload=b"x"), timeout=30) for _ in range(n)]
        codes = [f.code() for f in waiting]
        assert first.code() == grpc.StatusCode.OK
    return codes


def test_calls_beyond_max_pending_calls_are_refused_and_the_default_holds_a_burst():
    """gRPC refuses the calls beyond `max_pending_calls` that wait for the server (as CANCELLED);
    the default holds a burst far larger than gRPC's own limit of 1000 would let through a
    busy loop."""
    few = codes_of_calls_that_wait(40, max_pending_calls=4)
    assert few.count(grpc.StatusCode.CANCELLED) >= 40 - 4 - 4
    assert set(few) == {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED}
    assert ServerOptions().max_pending_calls >= 8192
    assert set(codes_of_calls_that_wait(2000)) == {grpc.StatusCode.OK}


@pytest.mark.parametrize("field", ["max_pending_calls", "max_workers", "max_receive_message_bytes"])
def test_server_options_refuse_a_size_below_one_naming_it(field):
    with pytest.raises(ValueError, match=f"ServerOptions.{field} must be >= 1, got 0"):
        ServerOptions(**{field: 0})


def test_refuses_to_start_with_an_inconsistent_entry_table(monkeypatch):
    broken = entries.Wrapper("NoSuchInnerForCausalLM", "text_config", entries._top_level_quantization)
    monkeypatch.setitem(entries.ENTRY_CLASSES, "BrokenWrapperForCausalLM", broken)
    with pytest.raises(ServerStartError) as info:
        RegistryServer(FakePlanStore(), ServerOptions(listen="127.0.0.1:0"))
    assert "BrokenWrapperForCausalLM" in str(info.value)


def test_a_busy_port_is_refused(server):
    with pytest.raises(ServerStartError) as info:
        RegistryServer(FakePlanStore(), ServerOptions(listen=server.address))
    assert server.address in str(info.value)


def test_graceful_stop_lets_in_flight_calls_finish():
    import threading

    class SlowStore(FakePlanStore):
        def save_plan(self, new):
            entered.set()
            time.sleep(0.5)
            return super().save_plan(new)

    entered = threading.Event()
    store = SlowStore()
    srv = RegistryServer(store, ServerOptions(listen="127.0.0.1:0")).start()
    results = []

    def call():
        with RegistryClient(srv.address, timeout=5, max_attempts=1) as c:
            results.append(c.resolve_load_plan(request()))

    t = threading.Thread(target=call)
    t.start()
    assert entered.wait(5)
    srv.stop(grace=5)
    t.join(5)
    assert len(results) == 1 and store.count() == 1


def test_resolves_are_saved_through_the_group_commit_and_reported(db_url):
    """The server saves plans through one group commit over the store's `save_batch` (not the
    sync `save_plan`), and `ServerOptions.on_commit` hears each commit's latency and size; each
    answered plan is the stored one."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from loadplan.service.store.db import make_engine
    from loadplan.service.store.repository import SqlPlanStore

    engine = make_engine(db_url)
    store = SqlPlanStore(engine)
    store.save_plan = None      # the sync way must not be taken: it would fail the call
    commits: list[tuple[float, int]] = []
    options = ServerOptions(listen="127.0.0.1:0", on_commit=lambda s, n: commits.append((s, n)))
    try:
        with RegistryServer(store, options) as srv, RegistryClient(srv.address, timeout=10) as client:
            with ThreadPoolExecutor(8) as pool:
                plans = list(pool.map(client.resolve_load_plan, [request_for(rank % 4) for rank in range(16)]))
            assert sum(n for _, n in commits) == 16 and all(s > 0 for s, _ in commits)
            stored = [client.get_plan(p.plan_id) for p in plans]
            assert [dataclasses.replace(p, history=()) for p in stored] == plans
    finally:
        engine.dispose()


def request_for(rank: int):
    import uuid

    from loadplan.plan import Parallel
    return request(request_id=f"wired-{uuid.uuid4().hex}", deployment_id=f"wired-{uuid.uuid4().hex[:8]}",
                   parallel=Parallel(ep_size=8, ep_rank=rank))
