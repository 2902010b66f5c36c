"""`AcceptAhead` (service/accept_ahead.py): several calls of a method accepted at a time, each
handed to grpc's own per-call code, interceptors included; grpc's accept loop alone otherwise."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from fake_store import FakePlanStore

from loadplan.service import accept_ahead
from loadplan.service.auth import load_tokens
from loadplan.service.server import RegistryServer, ServerOptions, ServerStartError
from loadplan.v1 import registry_pb2 as pb

ECHO = "/loadplan.v1.ModelRegistry/Echo"
LIST_PLANS = "/loadplan.v1.ModelRegistry/ListPlans"   # readers and admins only


def _start(**options) -> RegistryServer:
    options = {"listen": "127.0.0.1:0", "max_workers": 4, "readiness_interval_s": 0.05, **options}
    return RegistryServer(FakePlanStore(), ServerOptions(**options)).start()


async def _burst(address: str, path: str, n: int, metadata=None) -> list:
    """n concurrent calls; each one's answer (bytes) or its status code."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)

        async def one(i: int):
            request = pb.EchoRequest(payload=f"call {i}".encode()).SerializeToString() if path == ECHO else b""
            try:
                return await call(request, timeout=10, metadata=metadata)
            except grpc.aio.AioRpcError as e:
                return e.code()

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_a_verified_grpc_has_what_accepting_ahead_uses_and_any_grpc_serves():
    """On a grpcio release `AcceptAhead` was checked against, it must be active (a silent fall
    back to one call of a method at a time would be a regression); on another, the server serves
    either way (and says which in its log)."""
    server = _start(accept_ahead=accept_ahead.DEFAULT_DEPTH)
    try:
        answers = asyncio.run(_burst(server.address, ECHO, 20))
        assert all(isinstance(a, bytes) for a in answers), answers
        if grpc.__version__.startswith(accept_ahead.VERIFIED_GRPCIO):
            assert accept_ahead.supported(server._server) is None
            assert server.accept_ahead.active
        else:
            assert server.accept_ahead.active == (accept_ahead.supported(server._server) is None)
    finally:
        server.stop(grace=0.5)


def test_concurrent_calls_are_accepted_ahead_and_each_gets_its_own_answer():
    server = _start(accept_ahead=4)
    try:
        answers = asyncio.run(_burst(server.address, ECHO, 200))
        assert [pb.EchoResponse.FromString(a).payload for a in answers] == [f"call {i}".encode() for i in range(200)]
        # (on a grpcio it does not support, grpc's own loop took them all: the first test covers that)
        assert (server.accept_ahead.accepted > 0) == server.accept_ahead.active
    finally:
        server.stop(grace=0.5)
    assert not server.accept_ahead.active
    assert not server.accept_ahead._calls


def test_interceptors_judge_the_calls_accepted_ahead():
    tokens = load_tokens(environ={"LOADPLAN_TOKENS": "worker:worker-token-0123456789,reader:reader-token-0123456789"})
    # Ahead-of-time requests outnumber grpc's own (8 to 1 per method): most calls go through them.
    server = _start(accept_ahead=8, tokens=tokens)
    try:
        unauthenticated = asyncio.run(_burst(server.address, LIST_PLANS, 40))
        wrong_role = asyncio.run(_burst(server.address, LIST_PLANS, 40, metadata=(("authorization", "Bearer worker-token-0123456789"),)))
        allowed = asyncio.run(_burst(server.address, LIST_PLANS, 40, metadata=(("authorization", "Bearer reader-token-0123456789"),)))
        accepted, active = server.accept_ahead.accepted, server.accept_ahead.active
    finally:
        server.stop(grace=0.5)
    assert unauthenticated == [grpc.StatusCode.UNAUTHENTICATED] * 40
    assert wrong_role == [grpc.StatusCode.PERMISSION_DENIED] * 40
    assert all(isinstance(a, bytes) for a in allowed), allowed
    pb.ListPlansResponse.FromString(allowed[0])
    assert accepted > 60 if active else accepted == 0, accepted


def test_depth_zero_the_default_leaves_grpcs_own_accept_loop():
    assert ServerOptions().accept_ahead == 0
    server = _start(accept_ahead=0)
    try:
        answers = asyncio.run(_burst(server.address, ECHO, 50))
        assert len(answers) == 50 and all(isinstance(a, bytes) for a in answers)
        assert not server.accept_ahead.active and server.accept_ahead.accepted == 0
    finally:
        server.stop(grace=0.5)


def test_a_negative_depth_is_refused():
    with pytest.raises(ServerStartError, match="accept_ahead"):
        RegistryServer(FakePlanStore(), ServerOptions(listen="127.0.0.1:0", accept_ahead=-1))


def test_a_grpc_without_those_parts_is_served_by_its_own_loop_and_says_so(caplog):
    class OtherServer:   # a grpc.aio.Server of another make: no `_server` core
        pass

    ahead = accept_ahead.AcceptAhead(OtherServer(), {ECHO: object()}, None, depth=4)
    with caplog.at_level(logging.WARNING, logger="loadplan.service"):
        asyncio.run(ahead.start())
    assert not ahead.active
    assert "one call at a time" in caplog.text and "_request_registered_call" in caplog.text


def test_a_changed_signature_is_not_used(monkeypatch):
    from grpc._cython import cygrpc

    server = _start(accept_ahead=0)
    try:
        monkeypatch.setattr(cygrpc, "_handle_rpc", lambda method_name, rpc_state: None)
        assert "_handle_rpc" in accept_ahead.supported(server._server)
    finally:
        monkeypatch.undo()
        server.stop(grace=0.5)


@pytest.mark.parametrize("depth, unsupported", [(4, False), (0, False), (4, True)], ids=["ahead", "stock", "fallback"])
def test_batches_fill_shorter_only_while_calls_are_accepted_ahead(tmp_path, monkeypatch, depth, unsupported):
    """Calls accepted ahead reach the group commit as fast as clients send them: a 6 ms fill
    would gather every call in flight into one batch, so the writer fills for 1 ms, in steps
    shorter than that; with grpc's own accept loop (asked for, or fallen back to) it keeps its
    6 ms in 1 ms steps."""
    from loadplan.service.store import SqlPlanStore, make_engine, migrate
    from loadplan.service.store.async_writer import FILL_STEP_AHEAD_S, FILL_STEP_S, FILL_WAIT_AHEAD_S, FILL_WAIT_S

    if unsupported:
        monkeypatch.setattr(accept_ahead, "supported", lambda server: "a grpcio without it")
    url = f"sqlite:///{tmp_path / 'r.db'}"
    migrate(url)
    engine = make_engine(url)
    server = RegistryServer(SqlPlanStore(engine), ServerOptions(listen="127.0.0.1:0", max_workers=4,
                                                                accept_ahead=depth)).start()
    try:
        assert server.accept_ahead.active == (depth > 0 and not unsupported)
        group = server.writer.group
        assert group.fill_wait_s == (FILL_WAIT_AHEAD_S if server.accept_ahead.active else FILL_WAIT_S)
        assert group.fill_step_s == (FILL_STEP_AHEAD_S if server.accept_ahead.active else FILL_STEP_S)
        assert FILL_STEP_AHEAD_S < FILL_WAIT_AHEAD_S < FILL_WAIT_S
        assert FILL_STEP_S < FILL_WAIT_S
    finally:
        server.stop(grace=0.5)
        engine.dispose()
