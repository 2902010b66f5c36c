"""The registry's Prometheus metrics (`prometheus_client`), served at `/metrics` by service/http.

    loadplan_resolves_total{status, role, engine, family}   counter: ResolveLoadPlan calls by outcome
    loadplan_resolve_seconds{status}                        histogram: a resolve's time in the server
    loadplan_db_commit_seconds                              histogram: one group commit's write
    loadplan_db_commit_plans                                histogram: plans per group commit
    loadplan_serving                                        gauge: 1 while health says SERVING

Resolves are counted by a gRPC server interceptor (`ResolveMetrics`), outside the
servicer, so the count covers every answer, refusals by authentication included.
`status` is the gRPC code's name (OK, INVALID_ARGUMENT, ...); `role` the request's
role (target, speculative; "" for a call refused before its request was read:
UNAUTHENTICATED, PERMISSION_DENIED); `engine` the engine of the answered plan's runtime
(what decided; the request's when it was refused); `family` the answered plan's
`model.family` decision ("" when refused). Each metric set lives in a registry of
its own, so two servers in one process (the tests) do not share counts.
"""

from __future__ import annotations

import time
from typing import Callable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the HTTP app

from loadplan.plan import Keys
from loadplan.v1 import registry_pb2 as pb

RESOLVE_METHOD = f"/{pb.DESCRIPTOR.services_by_name['ModelRegistry'].full_name}/ResolveLoadPlan"
ROLE_NAMES = {pb.ROLE_UNSPECIFIED: "target", pb.ROLE_TARGET: "target", pb.ROLE_SPECULATIVE: "speculative"}

# A resolve takes ~1-10 ms under load, a commit ~0.2-5 ms; a stalled database shows in the top buckets.
RESOLVE_BUCKETS = (.0005, .001, .0025, .005, .0075, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
COMMIT_BUCKETS = (.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5)
GROUP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class RegistryMetrics:
    """One server's metrics; `render()` is the `/metrics` body."""

    def __init__(self):
        self._serving: Callable[[], bool] = lambda: False
        self.registry = CollectorRegistry(auto_describe=True)
        self.resolves = Counter("loadplan_resolves", "ResolveLoadPlan calls answered, by outcome",
                                ("status", "role", "engine", "family"), registry=self.registry)
        self.resolve_seconds = Histogram("loadplan_resolve_seconds", "Time a resolve spends in the server",
                                         ("status",), buckets=RESOLVE_BUCKETS, registry=self.registry)
        self.commit_seconds = Histogram("loadplan_db_commit_seconds",
                                        "Time one group commit takes to write its plans to the database",
                                        buckets=COMMIT_BUCKETS, registry=self.registry)
        self.commit_plans = Histogram("loadplan_db_commit_plans", "Plans written by one group commit",
                                      buckets=GROUP_BUCKETS, registry=self.registry)
        self.serving = Gauge("loadplan_serving", "1 while the registry's health is SERVING (database "
                             "reachable and migrated), else 0", registry=self.registry)
        self.serving.set_function(lambda: 1.0 if self._serving() else 0.0)

    def follow(self, server) -> None:
        """Report `server`'s health (a `RegistryServer`; its `serving`). Its group commits are
        timed by `ServerOptions(on_commit=metrics.observe_commit)`."""
        self._serving = lambda: server.serving

    def observe_commit(self, seconds: float, n_plans: int) -> None:
        """The group commit's `on_commit(seconds, n_plans)` (ServerOptions.on_commit): one batch written."""
        self.commit_seconds.observe(seconds)
        self.commit_plans.observe(n_plans)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Labels:
    """Engine and family of an answer, remembered by the answer's config and runtime: the ranks
    of a deployment repeat them, and reading them means parsing the answer."""

    LIMIT = 1024

    def __init__(self):
        self._known: dict[tuple[str, bytes], tuple[str, str]] = {}

    def of(self, request: pb.ResolveLoadPlanRequest, answer) -> tuple[str, str]:
        key = (request.config_json, request.runtime.SerializeToString())
        labels = self._known.get(key)
        if labels is None:
            plan = pb.LoadPlan.FromString(answer) if isinstance(answer, (bytes, bytearray)) else answer
            family = next((d.value_json.strip('"') for d in plan.decisions if d.key == Keys.ENTRY_FAMILY), "")
            labels = (_engine(plan.runtime) or _engine(request.runtime), family)
            if len(self._known) >= self.LIMIT:
                self._known.clear()
            self._known[key] = labels
        return labels


def _engine(runtime: pb.Runtime) -> str:
    # `Runtime.engine` arrives with the engine contract; before it every plan is the default's.
    return getattr(runtime, "engine", "")


class ResolveMetrics(grpc.aio.ServerInterceptor):
    """Counts and times ResolveLoadPlan; every other method passes untouched."""

    def __init__(self, metrics: RegistryMetrics):
        self.metrics = metrics
        self._labels = _Labels()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler_call_details.method != RESOLVE_METHOD or handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        metrics, labels_of = self.metrics, self._labels.of

        async def counted(request, context):
            start = time.perf_counter()
            answer = None
            try:
                answer = await inner(request, context)
                return answer
            finally:
                code = context.code()
                if code is None:
                    code = grpc.StatusCode.OK if answer is not None else grpc.StatusCode.UNKNOWN
                status = code.name if isinstance(code, grpc.StatusCode) else str(code)
                metrics.resolve_seconds.labels(status).observe(time.perf_counter() - start)
                if not isinstance(request, pb.ResolveLoadPlanRequest):
                    role, engine, family = "", "", ""      # refused before decoding (authentication)
                else:
                    role = ROLE_NAMES.get(request.role, str(request.role))
                    engine, family = (labels_of(request, answer) if status == "OK" and answer is not None
                                      else (_engine(request.runtime), ""))
                metrics.resolves.labels(status, role, engine, family).inc()

        return grpc.unary_unary_rpc_method_handler(counted, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)
