"""Server wiring: the registry servicer, health, reflection, limits, readiness.

The server is grpc.aio on an event loop of its own thread: RPCs are coroutines,
so a resolve that waits for its group commit (service/store/group_commit.py)
holds no thread. Blocking work (the store's reads, and each group commit's
`save_batch`) runs on `max_workers` threads. The class is used from ordinary
threads: `start`, `stop` and `wait` block their caller and run what they must
on the loop.

Health (grpc.health.v1) says NOT_SERVING until the store is ready (database
reachable and migrated) and follows it afterwards: a background thread asks
`store.ready()` about once a second, so a load balancer drains a replica whose
database went away and brings it back when the database returns.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from loadplan.v1 import registry_pb2 as pb
from loadplan.v1 import registry_pb2_grpc as pb_grpc
from . import auth, reflection_v1
from .auth import TokenStore
from .registry import PlanStore, Registry
from .rules import entries
from .tls import ServerTls, add_port
from .store.group_commit import GroupCommit
from .transport.servicer import ModelRegistryServicer

log = logging.getLogger("loadplan.service")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ModelRegistry"].full_name   # "loadplan.v1.ModelRegistry"
DEFAULT_MAX_RECEIVE_BYTES = 4 * 1024 * 1024
# The calls gRPC holds before the server takes them up; beyond it gRPC refuses new ones, and
# the client sees CANCELLED, which it does not retry. gRPC's own default is 1000, about one
# replica's share of a fleet start: in bench/fleet.py, 1024 ranks a replica lost a call in 3 of
# some 270 fleet starts, and 2048 a replica lost 100-400 calls in every one (README, Replicas).
DEFAULT_MAX_PENDING_CALLS = 8192
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServerStartError(RuntimeError):
    """The server cannot start: an inconsistent rules table, or an address it cannot bind."""


@dataclass(frozen=True)
class ServerOptions:
    listen: str = "127.0.0.1:50051"
    max_receive_message_bytes: int = DEFAULT_MAX_RECEIVE_BYTES   # larger requests: RESOURCE_EXHAUSTED
    # Threads for the store's blocking calls (reads, appends, each group commit's save_batch).
    max_workers: int = 64
    max_pending_calls: int = DEFAULT_MAX_PENDING_CALLS
    readiness_interval_s: float = 1.0
    # A store that has not answered readiness within this is NOT_SERVING (a stalled database).
    readiness_timeout_s: float = 2.0
    grace_s: float = 5.0
    tokens: TokenStore | None = None     # bearer tokens and roles (service/auth.py); None: open
    tls: ServerTls | None = None         # TLS / mutual TLS (service/tls.py); None: plaintext
    # Called after each group commit with its latency (s) and its number of plans (metrics).
    on_commit: Callable[[float, int], None] | None = None
    # Interceptors run before authentication's, outermost first (service/metrics.py counts resolves).
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()

    def __post_init__(self):
        for name in ("max_receive_message_bytes", "max_workers", "max_pending_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerOptions.{name} must be >= 1, got {getattr(self, name)}")


class _Probe:
    """One readiness question on its own daemon thread."""

    def __init__(self, ask):
        self._ask = ask
        self._answer: bool | BaseException = False
        self._done = threading.Event()
        threading.Thread(target=self._run, name="loadplan-readiness-probe", daemon=True).start()

    def _run(self) -> None:
        try:
            self._answer = bool(self._ask())
        except BaseException as e:  # noqa: BLE001 - handed to the asker
            self._answer = e
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float) -> bool:
        if not self._done.wait(timeout):
            raise TimeoutError(f"no answer within {timeout}s")
        if isinstance(self._answer, BaseException):
            raise self._answer
        return self._answer


class RegistryServer:
    """A started-on-demand gRPC server; `start()` returns self, `stop()` drains in-flight calls."""

    def __init__(self, store: PlanStore, options: ServerOptions = ServerOptions()):
        problems = entries.check_table()
        if problems:
            raise ServerStartError("entry class table is inconsistent: " + "; ".join(problems))
        if options.tokens and auth.check_table():
            raise ServerStartError("RPC role table is inconsistent: " + "; ".join(auth.check_table()))
        self.store = store
        self.options = options
        self._executor = futures.ThreadPoolExecutor(max_workers=options.max_workers,
                                                    thread_name_prefix="loadplan-rpc")
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="loadplan-grpc", daemon=True)
        self._loop_thread.start()
        self.group_commit: GroupCommit | None = None   # over the store's save_batch, for the loop's resolves
        self._stopped = False
        try:
            self.port = self._call(self._build())
        except BaseException:
            self._close_loop()
            raise
        host = options.listen.rsplit(":", 1)[0]
        self.address = f"{host}:{self.port}"
        self._stop = threading.Event()
        self._probe_lock = threading.Lock()
        self._probe: _Probe | None = None
        self._watcher: threading.Thread | None = None
        self.serving = False

    async def _build(self) -> int:
        """On the loop: the aio server, its services, its port (the port bound)."""
        options = self.options
        self.health = health.aio.HealthServicer()
        await self._publish(NOT_SERVING)
        interceptors = list(options.interceptors) + auth.interceptors(options.tokens)
        self._server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", options.max_receive_message_bytes),
                     # Without this, Linux lets a second server bind the same port and
                     # silently share its traffic; a busy port must be an error.
                     ("grpc.so_reuseport", 0),
                     # Up to this many calls wait for the loop, more are refused (no random early refusals).
                     ("grpc.server.max_pending_requests", options.max_pending_calls),
                     ("grpc.server.max_pending_requests_hard_limit", options.max_pending_calls)],
            interceptors=interceptors,
        )
        self.group_commit = GroupCommit(self.store.save_batch, run_blocking=self._blocking,
                                        on_commit=options.on_commit)
        registry = Registry(self.store, save=self.group_commit.save)
        pb_grpc.add_ModelRegistryServicer_to_server(ModelRegistryServicer(registry, blocking=self._blocking),
                                                    self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection_v1.enable((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
                             self._server)
        try:
            port = add_port(self._server, options.listen, options.tls)
        except RuntimeError as e:
            await self._server.stop(None)
            raise ServerStartError(f"cannot listen on {options.listen}: {e}") from None
        if not port:
            await self._server.stop(None)
            raise ServerStartError(f"cannot listen on {options.listen}")
        return port

    def _blocking(self, fn, *args: Any) -> asyncio.Future:
        """Run `fn(*args)` on a worker thread; awaitable on the loop."""
        return self._loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def _call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run `coro` on the loop and wait for its result (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _publish(self, status) -> None:
        for name in (SERVICE_NAME, ""):
            await self.health.set(name, status)

    # --- readiness -------------------------------------------------------------

    def _set_health(self, status) -> None:
        if not self._stopped:
            self._call(self._publish(status), timeout=10)

    def _ask_store(self) -> bool:
        """`store.ready()`, but at most `readiness_timeout_s`: a database that stops answering
        leaves the question on a helper thread (asked again only once it returns)."""
        with self._probe_lock:
            probe = self._probe
            if probe is None or probe.done():
                probe = self._probe = _Probe(self.store.ready)
        return probe.result(self.options.readiness_timeout_s)

    def check_ready(self) -> bool:
        """Ask the store once and publish the answer on the health service."""
        try:
            ready = self._ask_store()
        except TimeoutError:
            log.warning("store readiness check did not answer within %.1fs", self.options.readiness_timeout_s)
            ready = False
        except Exception:  # noqa: BLE001 - a store that cannot answer is not ready
            log.exception("store readiness check failed")
            ready = False
        if ready != self.serving:
            log.info("registry %s", "SERVING" if ready else "NOT_SERVING (database not reachable or not migrated)")
        self.serving = ready
        self._set_health(SERVING if ready else NOT_SERVING)
        return ready

    def _watch(self) -> None:
        while not self._stop.wait(self.options.readiness_interval_s):
            self.check_ready()

    # --- lifecycle -------------------------------------------------------------

    def start(self) -> "RegistryServer":
        self._call(self._start())
        auth.announce(self.options.tokens, self.address)
        self.check_ready()
        self._watcher = threading.Thread(target=self._watch, name="loadplan-readiness", daemon=True)
        self._watcher.start()
        return self

    def wait(self) -> None:
        """Block until the server has stopped (`stop` from another thread)."""
        self._loop_thread.join()

    def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, refuse new calls, let in-flight ones finish within `grace`."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        try:
            self._call(self._shutdown(self.options.grace_s if grace is None else grace))
        finally:
            self._close_loop()

    async def _start(self) -> None:
        await self._server.start()

    async def _shutdown(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)
        if self.group_commit is not None:
            await self.group_commit.aclose()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()
        self._executor.shutdown(wait=False)

    def __enter__(self) -> "RegistryServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(store: PlanStore, options: ServerOptions = ServerOptions()) -> RegistryServer:
    """Build and start a registry server on `store`."""
    return RegistryServer(store, options).start()
