"""`AcceptAhead`: several calls of one method accepted at a time by a grpc.aio server.

grpc.aio's server (`AioServer._server_main_loop` in grpcio's Cython) keeps ONE
call request outstanding per registered method. When a call arrives, the next
request for that method is made only after the main loop has woken up for it:
the completion crosses from gRPC core's poller thread to the event loop, then
takes several loop iterations (the request's task ends, `asyncio.wait` over
every method's request returns, the main loop starts the call's task and makes
the next request). Under load every loop iteration is long, so calls wait in
gRPC core while the loop is idle between hand-offs. Measured with
bench/registry.py at 64 calls in flight on 2 cores: a call waited 16 ms of its
17 ms before its handler started, and the loop thread was idle a quarter of
the time.

`AcceptAhead` keeps `depth` more requests outstanding for each of the methods
it is given, each in a coroutine of its own that hands every call it gets to
grpc's own per-call code, `_handle_rpc` under `_schedule_rpc_coro` (what the
main loop does with a call, interceptors included), and asks for the next call
at once. Calls are then accepted as fast as they arrive. Measured by
bench/registry.py (PostgreSQL, 64 in flight, 2 cores), depth 4 against 0: Echo
1.7-1.9x and ResolveLoadPlan 1.02-1.17x the calls per second, p50 latency 8 ms
instead of 16 (Echo) and 20 instead of 21-24 (resolve). Since the server's group
commit fills for 1 ms instead of its default (3 ms then) when calls are accepted ahead
(store/async_writer.py, `FILL_WAIT_AHEAD_S`), resolves gain 1.3x (Echo 1.6x),
measured with servers side by side in alternating rounds.

It uses private parts of grpcio's Cython server (`supported` checks them; see
`_REQUIRED`). Where they are missing or differ (another grpcio), the server
runs with grpc's own accept loop alone and says so in its log. Because of that
dependency it is opt-in (`ServerOptions.accept_ahead`, `serve --accept-ahead N`):
the gain for resolves is moderate (their own work, not the accept, bounds them),
the risk is a grpcio upgrade.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Mapping, Sequence

import grpc

log = logging.getLogger("loadplan.service")

# Extra call requests kept outstanding per method, when asked for (`serve --accept-ahead N`;
# off by default: see the module's docstring). Measured at 64 calls in flight on 2 cores: 4.
DEFAULT_DEPTH = 4

# grpcio releases whose server code `AcceptAhead` was read against and measured with: on these,
# tests require it to be active (tests/service/transport/test_accept_ahead.py).
VERIFIED_GRPCIO = ("1.85.",)

# What is used of grpcio's Cython module, with the parameters it must take (grpcio 1.85).
_REQUIRED = {
    "_handle_rpc": ("method_name", "method_resolver", "interceptors", "rpc_state", "loop", "concurrency_exceeded"),
    "_schedule_rpc_coro": ("rpc_coro", "rpc_state", "loop", "method_name"),
}


def _cygrpc():
    from grpc._cython import cygrpc
    return cygrpc


def supported(server: grpc.aio.Server) -> str | None:
    """None when `server` has what `AcceptAhead` uses, else what it lacks."""
    core = getattr(server, "_server", None)
    if core is None or not hasattr(core, "_request_registered_call"):
        return "grpc.aio.Server has no _server._request_registered_call"
    try:
        cygrpc = _cygrpc()
    except ImportError as e:
        return f"grpc._cython.cygrpc: {e}"
    for name, params in _REQUIRED.items():
        fn = getattr(cygrpc, name, None)
        if fn is None:
            return f"grpc._cython.cygrpc has no {name}"
        try:
            got = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return f"grpc._cython.cygrpc.{name}: no signature"
        if got != params:
            return f"grpc._cython.cygrpc.{name} takes {got}, not {params}"
    return None


class _Resolver:
    """The handler of a method by its path (what grpc's `_MethodResolver` finds for a registered one)."""

    def __init__(self, handlers: Mapping[str, grpc.RpcMethodHandler]):
        self._handlers = dict(handlers)

    def resolve_handler(self, details) -> grpc.RpcMethodHandler | None:
        return self._handlers.get(details.method)


class AcceptAhead:
    """For a STARTED grpc.aio `server` whose registered methods include `handlers` (by path,
    "/package.Service/Method"), served with `interceptors` (those the server was built with):
    `await start()` on the server's loop, `await stop()` after the server stopped."""

    def __init__(self, server: grpc.aio.Server, handlers: Mapping[str, grpc.RpcMethodHandler],
                 interceptors: Sequence[Any] | None, depth: int = DEFAULT_DEPTH):
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self._server = server
        self._handlers = handlers
        self._interceptors = tuple(interceptors or ())
        self.depth = depth
        self._acceptors: set[asyncio.Task] = set()
        self._calls: set[asyncio.Task] = set()
        self.accepted = 0          # calls accepted by the requests made here (tests, tuning)
        self.active = False

    async def start(self) -> None:
        if not self.depth or not self._handlers:
            return
        missing = supported(self._server)
        if missing is not None:
            log.warning("accepting one call at a time per method (grpc's own accept loop): %s", missing)
            return
        loop = asyncio.get_running_loop()
        resolver = _Resolver(self._handlers)
        for path in self._handlers:
            for _ in range(self.depth):
                self._acceptors.add(loop.create_task(self._accept(path, resolver), name=f"accept-ahead {path}"))
        self.active = True

    async def _accept(self, path: str, resolver: _Resolver) -> None:
        cygrpc = _cygrpc()
        core = self._server._server
        method = path.encode()
        loop = asyncio.get_running_loop()
        while True:
            try:
                rpc_state = await core._request_registered_call(method)
            except Exception:  # noqa: BLE001 - core fails outstanding requests when the server shuts down
                return
            self.accepted += 1
            call = cygrpc._handle_rpc(path, resolver, self._interceptors, rpc_state, loop, False)
            task = loop.create_task(cygrpc._schedule_rpc_coro(call, rpc_state, loop, path), name="rpc_task")
            # The loop keeps only a weak reference to a task: these keep the calls alive.
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def stop(self) -> None:
        """After the server stopped (its outstanding requests failed): wait for the acceptors and
        the calls they started; cancel an acceptor still waiting (a server that never started)."""
        if not self._acceptors:
            return
        _, pending = await asyncio.wait(self._acceptors, timeout=1.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._acceptors, *self._calls, return_exceptions=True)
        self._acceptors.clear()
        self.active = False
