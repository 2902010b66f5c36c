"""`ModelRegistryServicer`: gRPC in, use case, gRPC out. Nothing else.

Domain errors become their status (DESIGN 7) with the server's message and the
blamed field in trailing metadata `loadplan-field`; anything unexpected is
logged with its traceback under an incident id and answered INTERNAL with only
that id, so no internals leak to callers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from typing import Any, Awaitable, Callable

import grpc

from loadplan.client.errors import FIELD_METADATA_KEY
from loadplan.errors import FailedPrecondition, InvalidArgument, NotFound, RegistryError, Unavailable
from loadplan.v1 import registry_pb2 as pb
from loadplan.v1 import registry_pb2_grpc as pb_grpc
from .. import coverage
from ..registry import Registry
from . import convert

log = logging.getLogger("loadplan.service")

STATUS_OF: dict[type[RegistryError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}


# Status details and metadata travel in HTTP/2 trailers, which a client refuses beyond
# 16 KiB ("received metadata size exceeds hard limit"): a refusal quoting a huge input
# would reach the caller as RESOURCE_EXHAUSTED with its reason lost.
MAX_MESSAGE_LEN = 2000
MAX_FIELD_LEN = 256


def _sendable(message: str) -> str:
    """The message as valid UTF-8 (no unpaired surrogates), cut to MAX_MESSAGE_LEN characters."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(message) > MAX_MESSAGE_LEN:
        message = f"{message[:MAX_MESSAGE_LEN]}... (message cut, {len(message)} characters)"
    return message


def _metadata_text(text: str) -> str:
    """Metadata values are printable ASCII: anything else written as its escape (\\x1f, \\u00e9)."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii") for c in text)


def _status(err: RegistryError) -> grpc.StatusCode | None:
    for cls in type(err).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return None


def _rpc(method):
    @functools.wraps(method)
    async def handler(self, request, context):
        try:
            return await method(self, request, context)
        except RegistryError as e:
            code = _status(e)
            if code is None:  # a RegistryError subclass nobody mapped: a bug, not the caller's fault
                return await _internal(context, method.__name__, e)
            if e.field:
                field = _metadata_text(e.field)[:MAX_FIELD_LEN]
                context.set_trailing_metadata(((FIELD_METADATA_KEY, field),))
            await context.abort(code, _sendable(e.message))
        except Exception as e:  # noqa: BLE001 - the one place that turns bugs into INTERNAL
            return await _internal(context, method.__name__, e)
    return handler


async def _internal(context, name: str, err: BaseException):
    incident = uuid.uuid4().hex[:12]
    log.error("%s failed (incident %s)", name, incident, exc_info=err)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (incident {incident}; see the registry log)")


class ModelRegistryServicer(pb_grpc.ModelRegistryServicer):
    """For a grpc.aio server: every method is a coroutine on the server's event loop.

    Each method translates its request (`convert`), calls one use case of `Registry` and
    translates the answer back; errors become statuses (`_rpc`). A resolve runs the rules on
    the loop and awaits its save (`Registry.resolve_async`); the other use cases block on the
    database and run through `blocking(fn, *args)` (the server's worker threads)."""

    def __init__(self, registry: Registry, *, blocking: Callable[..., Awaitable[Any]] | None = None):
        self.registry = registry
        self._blocking = blocking or asyncio.to_thread

    @_rpc
    async def ResolveLoadPlan(self, request, context):
        req = convert.request_from_pb(request)
        # The config texts determine the parsed configs: the rules' key for what they decide
        # once per deployment (`rules.resolve.resolve_decisions`).
        plan = await self.registry.resolve_async(req, (request.config_json, request.quantization_config_json))
        return convert.answer_to_pb(plan)

    @_rpc
    async def RecordObservedPlan(self, request, context):
        req = convert.request_from_pb(request.request)
        decisions = convert.decisions_from_pb(request.decisions)
        return convert.plan_to_pb(await self._blocking(self.registry.record_observed, req, decisions))

    @_rpc
    async def GetPlan(self, request, context):
        plan = await self._blocking(self.registry.get_plan, request.plan_id, request.include_history)
        return convert.plan_to_pb(plan)

    @_rpc
    async def ListPlans(self, request, context):
        plans, token = await self._blocking(self.registry.list_plans, convert.filter_from_pb(request),
                                            request.page_size, request.page_token or None)
        return pb.ListPlansResponse(plans=[convert.plan_to_pb(p) for p in plans], next_page_token=token or "")

    @_rpc
    async def DiffPlans(self, request, context):
        return convert.diff_to_pb(await self._blocking(self.registry.diff_plans, request.plan_a, request.plan_b))

    @_rpc
    async def AppendDecisions(self, request, context):
        decisions = convert.decisions_from_pb(request.decisions)
        return convert.plan_to_pb(await self._blocking(self.registry.append_decisions, request.request_id,
                                                       request.plan_id, decisions))

    @_rpc
    async def ListBackends(self, request, context):
        engine, version, rows = self.registry.list_backends(request.engine, request.engine_version)
        return pb.ListBackendsResponse(backends=[convert.backend_to_pb(row) for row in rows], engine=engine,
                                       engine_version=version)

    @_rpc
    async def CheckCoverage(self, request, context):
        entries = coverage.check_coverage(request.entry_classes)
        return pb.CheckCoverageResponse(entries=[convert.coverage_to_pb(e) for e in entries],
                                        ok=all(e.ok for e in entries))

    @_rpc
    async def CheckUpgrade(self, request, context):
        report = await self._blocking(self.registry.upgrade_check, request.engine, request.to_version,
                                      request.from_version, request.deployment_id or None)
        return convert.upgrade_to_pb(report)

    @_rpc
    async def CheckCapabilities(self, request, context):
        report = await self._blocking(self.registry.check_capabilities, convert.request_from_pb(request))
        return convert.capabilities_to_pb(report)

    @_rpc
    async def Echo(self, request, context):
        return pb.EchoResponse(payload=request.payload)

