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
from typing import Any, Awaitable, Callable, TypeVar

import grpc

from ...client.errors import FIELD_METADATA_KEY
from ...v1 import registry_pb2 as pb
from ...v1 import registry_pb2_grpc as pb_grpc
from .. import coverage
from ..errors import FailedPrecondition, InvalidArgument, NotFound, RegistryError, Unavailable
from ...plan import LoadPlan
from ..registry import NewPlan, Registry
from ..rules.backends import BACKENDS
from . import convert, plan_wire
from .request_shapes import RequestShapes, shape_key

log = logging.getLogger("loadplan.service")
T = TypeVar("T")

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


async def _to_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _answer(texts: tuple[str, str | None], new: NewPlan, plan: LoadPlan) -> bytes:
    """The answer's bytes for `plan`, what the store answered for `new` (`Registry.new_plan` of a
    request whose stored config texts are `texts`): `new`'s plan encoded with those texts, else (a
    stored plan replayed) encoded whole."""
    if plan is new.plan:
        return plan_wire.plan_bytes(plan, config_json=texts[0], quantization_config_json=texts[1],
                                    unstamped=new.unstamped)
    return plan_wire.plan_bytes(plan)


class ModelRegistryServicer(pb_grpc.ModelRegistryServicer):
    """For a grpc.aio server: every method is a coroutine on the server's event loop.

    Work that blocks (the store's reads and writes) runs through `blocking(fn, *args)` (the
    server's: its worker threads); the rules are pure CPU and run on the loop. A resolve's plan
    is saved, and its answer derived, by `save_made` (the server's: its writer's
    `AsyncPlanWriter.save_made`, which awaits its group commit on the loop and makes the plan
    of a known request shape with its batch); without one, the plan is made here and saved by
    the store's `save_plan` through `blocking`."""

    def __init__(self, registry: Registry, *, blocking: Callable[..., Awaitable[Any]] | None = None,
                 save_made: Callable[[Callable[[], NewPlan], Callable[[NewPlan, LoadPlan], Any]], Awaitable[Any]]
                 | None = None):
        self.registry = registry
        self._blocking = blocking or _to_thread
        self._save_made = save_made or self._make_and_save
        self.shapes = RequestShapes()

    async def _make_and_save(self, make: Callable[[], NewPlan], answer: Callable[[NewPlan, LoadPlan], T]) -> T:
        """`save_made` where the server has no writer (`AsyncPlanWriter.save_made`): the plan made
        here and saved by the store's `save_plan` through `blocking`."""
        new = make()
        return answer(new, await self._blocking(self.registry.store.save_plan, new))

    @_rpc
    async def ResolveLoadPlan(self, request, context):
        """Answers with the plan's wire bytes (`plan_wire`; `add_to_server` sends them as they are).
        A request of a shape decided before is made like that one (`request_shapes`)."""
        key = shape_key(request)
        shape = self.shapes.get(key)
        if shape is not None:   # made by the batch's writer, with the batch's other plans (`save_made`)
            return await self._save_made(functools.partial(self.registry.new_plan_like, shape.first,
                                                           request.request_id, request.deployment_id), shape.answer)
        req = convert.request_from_pb(request)
        texts = convert.stored_config_texts(request)
        # The config texts determine the parsed configs: the rules' deployment cache key.
        new = self.registry.new_plan(req, (request.config_json, request.quantization_config_json), texts)
        # Saved, and answered, as a plan of a known shape is (the writer derives the answer while
        # the database commits); a shape is remembered once its first plan is saved.
        answered = await self._save_made(lambda: new, functools.partial(_answer, texts))
        self.shapes.remember(key, new)
        return answered

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
        return pb.ListBackendsResponse(backends=[convert.backend_to_pb(row) for row in BACKENDS.values()])

    @_rpc
    async def CheckCoverage(self, request, context):
        entries = coverage.check_coverage(request.entry_classes)
        return pb.CheckCoverageResponse(entries=[convert.coverage_to_pb(e) for e in entries],
                                        ok=all(e.ok for e in entries))

    @_rpc
    async def Echo(self, request, context):
        return pb.EchoResponse(payload=request.payload)


def _serialize(response) -> bytes:
    # ResolveLoadPlan answers with bytes already encoded; every other call with a message.
    return response if response.__class__ is bytes else response.SerializeToString()


def add_to_server(servicer: ModelRegistryServicer, server: grpc.aio.Server) -> dict[str, grpc.RpcMethodHandler]:
    """`pb_grpc.add_ModelRegistryServicer_to_server`, but every answer goes through `_serialize`,
    so that a method may answer with pre-encoded bytes. Returns the handlers by method path."""
    service = pb.DESCRIPTOR.services_by_name["ModelRegistry"]
    handlers = {}
    for method in service.methods:
        assert not (method.client_streaming or method.server_streaming), f"{method.name}: unary calls only"
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name), request_deserializer=getattr(pb, method.input_type.name).FromString,
            response_serializer=_serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
    return {f"/{service.full_name}/{name}": handler for name, handler in handlers.items()}
