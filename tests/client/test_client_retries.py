"""Deadlines and retries: UNAVAILABLE only, the same request (same request id) each time."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
from sample_requests import request

from loadplan.client import (DeadlineExceededError, InvalidArgumentError, RegistryCallError, RegistryClient,
                             UnavailableError)
from loadplan.v1 import registry_pb2 as pb
from loadplan.v1 import registry_pb2_grpc as pb_grpc


class ScriptedServicer(pb_grpc.ModelRegistryServicer):
    """Answers Echo from a script: each entry a status to abort with, a delay, or None for success."""

    def __init__(self, script):
        self.script = list(script)
        self.seen: list[bytes] = []

    def Echo(self, request, context):
        self.seen.append(request.payload)
        step = self.script.pop(0) if self.script else None
        if isinstance(step, (int, float)):
            time.sleep(step)
        elif step is not None:
            context.abort(step, f"scripted {step.name}")
        return pb.EchoResponse(payload=request.payload)


@pytest.fixture
def scripted():
    servers = []

    def start(script):
        servicer = ScriptedServicer(script)
        srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_ModelRegistryServicer_to_server(servicer, srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        srv.start()
        servers.append(srv)
        return servicer, f"127.0.0.1:{port}"

    yield start
    for srv in servers:
        srv.stop(0)


def test_store_unavailable_twice_then_success_reuses_the_request_id(client, store):
    store.fail_next_saves = 2
    req = request()
    plan = client.resolve_load_plan(req)
    assert store.save_calls == [req.request_id] * 3
    assert plan.request.request_id == req.request_id and not plan.replayed
    assert store.count() == 1


def test_gives_up_after_max_attempts(server, store):
    store.fail_next_saves = 100
    with RegistryClient(server.address, max_attempts=3, backoff=0.01) as c, pytest.raises(UnavailableError):
        c.resolve_load_plan(request())
    assert len(store.save_calls) == 3 and store.count() == 0


def test_invalid_argument_is_not_retried(client, store):
    with pytest.raises(InvalidArgumentError):
        client.resolve_load_plan(request(deployment_id=""))
    with pytest.raises(InvalidArgumentError):
        client.resolve_load_plan(request(request_id="bad id with spaces"))
    assert store.save_calls == []


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                  grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_only_unavailable_is_retried(scripted, code):
    servicer, address = scripted([code, None])
    with RegistryClient(address, backoff=0.01) as c, pytest.raises(RegistryCallError) as info:
        c.echo(b"once")
    assert info.value.code == code.name and "scripted" in info.value.message
    assert servicer.seen == [b"once"]


def test_unavailable_is_retried_with_the_same_message(scripted):
    servicer, address = scripted([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, None])
    with RegistryClient(address, backoff=0.01) as c:
        assert c.echo(b"same") == b"same"
    assert servicer.seen == [b"same"] * 3


def test_deadline_exceeded(scripted):
    servicer, address = scripted([2.0])
    t0 = time.monotonic()
    with RegistryClient(address, timeout=0.2) as c, pytest.raises(DeadlineExceededError) as info:
        c.echo(b"slow")
    assert info.value.code == "DEADLINE_EXCEEDED"
    assert time.monotonic() - t0 < 1.5
    assert servicer.seen == [b"slow"]        # not retried


def test_the_deadline_bounds_the_retries_too(scripted):
    servicer, address = scripted([grpc.StatusCode.UNAVAILABLE] * 100)
    t0 = time.monotonic()
    with RegistryClient(address, timeout=0.5, max_attempts=100, backoff=0.05) as c, \
            pytest.raises(RegistryCallError):
        c.echo(b"x")
    assert time.monotonic() - t0 < 1.5
    assert 1 < len(servicer.seen) < 100


def test_no_server_is_unavailable_after_retries():
    with RegistryClient("127.0.0.1:1", timeout=2, max_attempts=2, backoff=0.01) as c, \
            pytest.raises(UnavailableError):
        c.echo(b"x")


def test_retries_find_a_registry_that_comes_up(store):
    import socket
    import threading

    from loadplan.service.server import RegistryServer, ServerOptions

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    servers = []
    starter = threading.Timer(0.3, lambda: servers.append(
        RegistryServer(store, ServerOptions(listen=f"127.0.0.1:{port}")).start()))
    starter.start()
    try:
        with RegistryClient(f"127.0.0.1:{port}", timeout=5, max_attempts=30, backoff=0.05, max_backoff=0.1) as c:
            plan = c.resolve_load_plan(request())
        assert store.count() == 1 and plan.plan_id in store.plans
    finally:
        starter.join()
        for srv in servers:
            srv.stop(0)


def test_encoding_errors_are_invalid_argument_before_any_call(client, store):
    import dataclasses

    with pytest.raises(InvalidArgumentError) as info:
        client.resolve_load_plan(dataclasses.replace(request(), role="draft"))
    assert info.value.field == "role"
    with pytest.raises(InvalidArgumentError):
        client.list_plans(role="draft")
    with pytest.raises(InvalidArgumentError):
        client.resolve_load_plan(request(config={"architectures": ["X"], "bad": object()}))
    assert store.save_calls == []
