"""`RegistryClient`: the typed facade engine workers and the CLI use.

Every call has a deadline (`timeout`, covering the call and all its retries,
so a caller's wait is bounded). Only UNAVAILABLE is retried (the database or the
server is down for a moment), with exponential backoff and the very same
request message, so a retried resolve carries the same request id and the
registry replays the stored plan instead of writing a second one. Any other
status raises `RegistryCallError` at once.

Security (client/auth.py): `token` is sent as `authorization: Bearer <token>`
on every call; `tls_ca` / `tls_cert` / `tls_key` (file paths, or PEM bytes)
switch the channel to TLS, with a client certificate for mutual TLS. Unset, they
fall back to $LOADPLAN_TOKEN (or $LOADPLAN_TOKEN_FILE) and $LOADPLAN_TLS_CA /
_CERT / _KEY; `token=""` and `tls=False` turn them off whatever the environment says.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import time
from typing import Any, Callable, Iterator, Sequence

import grpc

from ..plan import Decision, LoadPlan, ResolveRequest
from ..upgrade import UpgradeReport
from ..v1 import registry_pb2 as pb
from ..v1 import registry_pb2_grpc as pb_grpc
from . import convert
from .auth import PemSource, bearer_metadata, open_channel, resolve_tls, resolve_token
from .errors import UnavailableError, error_for, from_rpc_error
from .types import BackendInfo, Candidate, CapabilityReport, CoverageEntry, CoverageReport, PlanDiff

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024   # plan pages can be larger than gRPC's 4 MiB default


class RegistryClient:
    def __init__(self, address: str, *, timeout: float = 10.0, max_attempts: int = 5, backoff: float = 0.1,
                 max_backoff: float = 2.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 sleep: Callable[[float], None] = time.sleep, token: str | None = None,
                 tls: bool | None = None, tls_ca: PemSource | None = None, tls_cert: PemSource | None = None,
                 tls_key: PemSource | None = None, tls_server_name: str | None = None):
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        self.address = address
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._sleep = sleep
        # Kept out of attributes a repr or a log line would show; sent with every call.
        self._metadata = bearer_metadata(resolve_token(token))
        self.tls = resolve_tls(tls, tls_ca, tls_cert, tls_key, tls_server_name)
        reconnect_ms = max(1, int(backoff * 1000))
        self._channel = open_channel(address, self.tls, options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # gRPC's own reconnect backoff starts at 1 s; while it waits, calls fail fast with
            # UNAVAILABLE. Keep it on the client's retry scale so a registry that restarts is
            # found again by the next retry instead of after all of them.
            ("grpc.initial_reconnect_backoff_ms", reconnect_ms),
            ("grpc.min_reconnect_backoff_ms", reconnect_ms),
            ("grpc.max_reconnect_backoff_ms", max(reconnect_ms, int(max_backoff * 1000))),
        ])
        self._stub = pb_grpc.ModelRegistryStub(self._channel)

    # --- lifecycle -------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "RegistryClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the calls ---------------------------------------------------------------

    def resolve_load_plan(self, request: ResolveRequest, *, timeout: float | None = None) -> LoadPlan:
        """The plan of one runner; a retried request id returns the stored plan (`replayed`)."""
        msg = _encode(convert.request_to_pb, request)
        return convert.plan_from_pb(self._call("ResolveLoadPlan", msg, timeout))

    def get_plan(self, plan_id: str, include_history: bool = False, *, timeout: float | None = None) -> LoadPlan:
        msg = pb.GetPlanRequest(plan_id=plan_id, include_history=include_history)
        return convert.plan_from_pb(self._call("GetPlan", msg, timeout))

    def list_plans(self, deployment_id: str | None = None, role: str | None = None, entry_class: str | None = None,
                   host: str | None = None, created_after: dt.datetime | None = None,
                   created_before: dt.datetime | None = None, page_size: int = 0, page_token: str | None = None,
                   *, timeout: float | None = None) -> tuple[list[LoadPlan], str | None]:
        """One page, newest first, and the token of the next page (None on the last)."""
        msg = pb.ListPlansRequest(deployment_id=deployment_id or "", role=_encode(convert.role_to_pb, role),
                                  entry_class=entry_class or "", host=host or "", page_size=page_size,
                                  page_token=page_token or "")
        if created_after is not None:
            msg.created_after.CopyFrom(convert.timestamp(created_after))
        if created_before is not None:
            msg.created_before.CopyFrom(convert.timestamp(created_before))
        reply = self._call("ListPlans", msg, timeout)
        return [convert.plan_from_pb(p) for p in reply.plans], reply.next_page_token or None

    def iter_plans(self, deployment_id: str | None = None, role: str | None = None, entry_class: str | None = None,
                   host: str | None = None, created_after: dt.datetime | None = None,
                   created_before: dt.datetime | None = None, page_size: int = 0,
                   *, timeout: float | None = None) -> Iterator[LoadPlan]:
        """Every matching plan, following the pages (each page is its own call with its own deadline)."""
        token = None
        while True:
            plans, token = self.list_plans(deployment_id, role, entry_class, host, created_after, created_before,
                                           page_size, token, timeout=timeout)
            yield from plans
            if not token:
                return

    def diff_plans(self, a: str, b: str, *, timeout: float | None = None) -> PlanDiff:
        reply = self._call("DiffPlans", pb.DiffPlansRequest(plan_a=a, plan_b=b), timeout)
        decisions = [(d.key,
                      convert.decision_from_pb(d.a) if d.in_a else None,
                      convert.decision_from_pb(d.b) if d.in_b else None) for d in reply.decisions]
        inputs = [(i.field, _json_or_none(i.a_json), _json_or_none(i.b_json)) for i in reply.inputs]
        return PlanDiff(convert.plan_from_pb(reply.a), convert.plan_from_pb(reply.b), decisions, inputs)

    def append_decisions(self, request_id: str, plan_id: str, decisions: Sequence[Decision],
                         *, timeout: float | None = None) -> LoadPlan:
        """Record decisions made after load (e.g. an EPLB rebalance); idempotent by request id."""
        msg = pb.AppendDecisionsRequest(request_id=request_id, plan_id=plan_id,
                                        decisions=_encode(convert.decisions_to_pb, decisions))
        return convert.plan_from_pb(self._call("AppendDecisions", msg, timeout))

    def list_backends(self, engine: str = "", engine_version: str = "", *,
                      timeout: float | None = None) -> list[BackendInfo]:
        """The a2a backends of `engine` ("" loadplan's own) at `engine_version` ("" its newest), as it spells them."""
        reply = self._call("ListBackends", pb.ListBackendsRequest(engine=engine, engine_version=engine_version),
                           timeout)
        return [BackendInfo(b.name, b.forward_path, b.combine_reduces, b.deepep_class, b.per_rank_fused_slots,
                            b.fusion_force_disabled, b.accepted, b.note, reply.engine, reply.engine_version)
                for b in reply.backends]

    def check_capabilities(self, request: ResolveRequest, *, timeout: float | None = None) -> CapabilityReport:
        """For `request`'s config and runtime: every a2a backend (and SGLang MoE runner) of its engine tried in its
        place, whether the engine would start with it and why (nothing is written)."""
        reply = self._call("CheckCapabilities", convert.request_to_pb(request), timeout)

        def candidates(msgs):
            return tuple(Candidate(c.name, c.starts, c.reason, c.forward_path, c.shared_experts_fusion) for c in msgs)
        return CapabilityReport(reply.engine, reply.engine_version, candidates(reply.backends),
                                candidates(reply.moe_runners))

    def check_coverage(self, entry_classes: Sequence[str] = (), *, timeout: float | None = None) -> CoverageReport:
        """Whether each entry class reaches a fusion gate; empty asks about the registry's own table."""
        reply = self._call("CheckCoverage", pb.CheckCoverageRequest(entry_classes=list(entry_classes)), timeout)
        entries = [CoverageEntry(e.entry_class, e.known, e.family, e.gated_family, e.has_gate, tuple(e.chain),
                                 e.message, e.ok) for e in reply.entries]
        return CoverageReport(entries, reply.ok)

    def record_observed_plan(self, request: ResolveRequest, decisions: Sequence[Decision],
                             *, timeout: float | None = None) -> LoadPlan:
        """What an engine release without a profile decided for this runner, recorded as its plan."""
        msg = pb.RecordObservedPlanRequest(request=convert.request_to_pb(request),
                                           decisions=convert.decisions_to_pb(decisions))
        return convert.plan_from_pb(self._call("RecordObservedPlan", msg, timeout))

    def upgrade_check(self, engine: str, to_version: str, from_version: str = "", deployment_id: str | None = None,
                      *, timeout: float | None = None) -> UpgradeReport:
        """What every stored deployment of `engine` (or the one named) would be planned under `to_version`."""
        msg = pb.CheckUpgradeRequest(engine=engine, to_version=to_version, from_version=from_version or "",
                                     deployment_id=deployment_id or "")
        return convert.upgrade_from_pb(self._call("CheckUpgrade", msg, timeout))

    def echo(self, payload: bytes = b"", *, timeout: float | None = None) -> bytes:
        return self._call("Echo", pb.EchoRequest(payload=payload), timeout).payload

    # --- deadline and retries ----------------------------------------------------------

    def _call(self, method: str, request: Any, timeout: float | None) -> Any:
        rpc = getattr(self._stub, method)
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        delay = self.backoff
        for attempt in range(1, self.max_attempts + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise error_for("DEADLINE_EXCEEDED", f"{method}: no time left for attempt {attempt} "
                                f"within {timeout:g}s")
            try:
                return rpc(request, timeout=remaining, metadata=self._metadata)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
            if not isinstance(err, UnavailableError) or attempt == self.max_attempts:
                raise err
            # Jitter keeps the ranks of a deployment from retrying in lock step.
            pause = min(delay, self.max_backoff) * random.uniform(0.5, 1.0)
            if time.monotonic() + pause >= deadline:
                raise err
            self._sleep(pause)
            delay *= 2
        raise AssertionError("unreachable")


def _encode(fn, *args):
    """Client-side encoding errors look like the server's: INVALID_ARGUMENT naming the field."""
    try:
        return fn(*args)
    except convert.WireError as e:
        raise error_for("INVALID_ARGUMENT", str(e), e.field) from None
    except (TypeError, ValueError) as e:   # e.g. a value json cannot encode
        raise error_for("INVALID_ARGUMENT", f"cannot encode the request: {e}") from None


def _json_or_none(text: str) -> Any:
    return json.loads(text) if text else None
