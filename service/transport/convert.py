"""Proto <-> domain for the service. Pure translation.

Plans go through the client's converter (one translation, both sides); here is
what only the service reads: requests, whose malformed parts become
INVALID_ARGUMENT naming the field, filters, diffs, backends and coverage.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any, NamedTuple

from ...client.convert import (WireError, config_to_json, datetime_of, decision_from_pb, decision_to_pb,
                               parallel_from_pb, plan_from_pb, plan_to_pb, role_from_pb, runtime_from_pb)
from ...plan import Decision, Parallel, ResolveRequest, Runtime
from ...v1 import registry_pb2 as pb
from ..errors import InvalidArgument
from ..registry import PlanDiff, PlanFilter
from ..rules.backends import BackendCapabilities

__all__ = ["plan_to_pb", "plan_from_pb", "request_from_pb", "filter_from_pb", "decisions_from_pb", "diff_to_pb",
           "backend_to_pb", "coverage_to_pb"]


def _json_object(text: str, field: str, *, required: bool) -> dict[str, Any] | None:
    doc = _document(text, field, required=required)
    return None if doc is None else doc.value


class _Document(NamedTuple):
    value: dict[str, Any]   # the parsed object, shared by every request that sent the same text
    stored: str             # `client.convert.config_to_json(value)`: the text the store and the wire carry


def _document(text: str, field: str, *, required: bool) -> _Document | None:
    """The config `text` parsed, remembered by text: every rank of a deployment sends the same
    config.json, parsed (and re-encoded for the store) once. The parsed object is shared between
    requests, which is safe because nothing on the resolve path changes a request's config
    (the domain treats a ResolveRequest as a value; tests/service/transport checks the cached
    documents stay as parsed). Refusals are not remembered."""
    global _documents_chars
    if not text:
        if required:
            raise InvalidArgument(field, "required (the checkpoint's config.json)")
        return None
    doc = _DOCUMENTS.get(text)
    if doc is not None:
        return doc
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(field, f"not valid JSON ({e})") from None
    except RecursionError:
        raise InvalidArgument(field, "nested too deeply") from None
    if not isinstance(value, dict):
        raise InvalidArgument(field, f"must be a JSON object, got {type(value).__name__}")
    if _depth(value) > MAX_JSON_DEPTH:
        raise InvalidArgument(field, f"nested deeper than {MAX_JSON_DEPTH} levels")
    doc = _Document(value, config_to_json(value))
    if len(text) <= DOCUMENTS_CHARS:
        with _documents_lock:
            if text not in _DOCUMENTS:
                _DOCUMENTS[text] = doc
                _documents_chars += len(text)
            while len(_DOCUMENTS) > DOCUMENTS_SIZE or _documents_chars > DOCUMENTS_CHARS:
                oldest = next(iter(_DOCUMENTS))
                del _DOCUMENTS[oldest]
                _documents_chars -= len(oldest)
    return doc


# Distinct config texts remembered (a fleet has a handful), oldest forgotten first; bounded in
# count and in characters too, since a parsed document takes several times its text's memory.
DOCUMENTS_SIZE = 256
DOCUMENTS_CHARS = 8 << 20
_DOCUMENTS: dict[str, _Document] = {}
_documents_chars = 0
_documents_lock = threading.Lock()


def stored_config_texts(msg: pb.ResolveLoadPlanRequest) -> tuple[str, str | None]:
    """`config_to_json(req.config)` and `quantization_config_to_json(req.quantization_config)` of
    `req = request_from_pb(msg)`, from the documents it parsed (computed again if forgotten
    since), but None for no quantization config: `NewPlan.config_json` and
    `quantization_config_json`, which the store writes as they are (None: it writes NULL)."""
    config = _document(msg.config_json, "config_json", required=True)
    qconfig = _document(msg.quantization_config_json, "quantization_config_json", required=False)
    return config.stored, None if qconfig is None else qconfig.stored


# Real checkpoint configs nest a few levels; the rules, fingerprints and the store walk
# configs recursively, so a pathological one is refused here, by name.
MAX_JSON_DEPTH = 64


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            break
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _wire(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except WireError as e:
        raise InvalidArgument(e.field, e.problem) from None


def request_from_pb(msg: pb.ResolveLoadPlanRequest) -> ResolveRequest:
    return ResolveRequest(
        request_id=msg.request_id,
        deployment_id=msg.deployment_id,
        role=_wire(role_from_pb, msg.role),
        # A request without the message gets the defaults (one rank); in a message that is
        # present an unset size (proto3's zero) means 1, as the proto says: a client that sets
        # only the sizes it uses (tp_size=8) must not be refused for dp_size. Negative sizes
        # and ranks are taken literally and refused naming the field.
        parallel=_shared(_PARALLELS, msg.parallel, _parallel_unset_sizes_one) if msg.HasField("parallel")
        else _ONE_RANK,
        host=msg.host,
        config=_json_object(msg.config_json, "config_json", required=True),
        quantization_config=_json_object(msg.quantization_config_json, "quantization_config_json",
                                         required=False),
        quantization=msg.quantization or None,
        runtime=_shared(_RUNTIMES, msg.runtime, runtime_from_pb) if msg.HasField("runtime") else _DEFAULT_RUNTIME,
    )


def _parallel_unset_sizes_one(msg: pb.Parallelism) -> Parallel:
    """`parallel_from_pb`, a zero size read as 1 (proto3 cannot tell unset from 0)."""
    return dataclasses.replace(parallel_from_pb(msg), **{f: 1 for f in _SIZES if getattr(msg, f) == 0})


_SIZES = ("tp_size", "ep_size", "pp_size", "dp_size")


def _shared(cache: dict[bytes, Any], msg, from_pb):
    """`from_pb(msg)`, one object per distinct message: Parallel and Runtime are frozen values
    that every rank (Runtime) or every deployment of a shape (Parallel) repeats, and building
    one costs several times looking it up by its bytes."""
    raw = msg.SerializeToString()
    value = cache.get(raw)
    if value is None:
        value = from_pb(msg)
        if len(cache) >= SHARED_SIZE:
            cache.clear()   # rare (a fleet has few shapes); simpler than an LRU and as bounded
        cache[raw] = value
    return value


SHARED_SIZE = 4096
_PARALLELS: dict[bytes, Parallel] = {}
_RUNTIMES: dict[bytes, Runtime] = {}
_ONE_RANK = Parallel()
_DEFAULT_RUNTIME = Runtime()


def filter_from_pb(msg: pb.ListPlansRequest) -> PlanFilter:
    return PlanFilter(
        deployment_id=msg.deployment_id or None,
        role=_wire(role_from_pb, msg.role, None),
        entry_class=msg.entry_class or None,
        host=msg.host or None,
        created_after=datetime_of(msg, "created_after"),
        created_before=datetime_of(msg, "created_before"),
    )


def decisions_from_pb(msgs) -> list[Decision]:
    return [_wire(decision_from_pb, m, f"decisions[{i}]") for i, m in enumerate(msgs)]


def diff_to_pb(diff: PlanDiff) -> pb.DiffPlansResponse:
    reply = pb.DiffPlansResponse(a=plan_to_pb(diff.a), b=plan_to_pb(diff.b))
    for key, a, b in diff.decisions:
        d = reply.decisions.add(key=key, in_a=a is not None, in_b=b is not None)
        if a is not None:
            d.a.CopyFrom(decision_to_pb(a))
        if b is not None:
            d.b.CopyFrom(decision_to_pb(b))
    for field, a, b in diff.inputs:
        reply.inputs.add(field=field, a_json=json.dumps(a), b_json=json.dumps(b))
    return reply


def backend_to_pb(row: BackendCapabilities) -> pb.Backend:
    return pb.Backend(name=row.name, forward_path=row.forward_path, combine_reduces=row.combine_reduces,
                      deepep_class=row.deepep_class, per_rank_fused_slots=row.per_rank_fused_slots,
                      fusion_force_disabled=row.fusion_force_disabled)


def coverage_to_pb(entry) -> pb.CoverageEntry:
    return pb.CoverageEntry(entry_class=entry.entry_class, known=entry.known, family=entry.family,
                            gated_family=entry.gated_family, has_gate=entry.has_gate, chain=list(entry.chain),
                            message=entry.message, ok=entry.ok)
