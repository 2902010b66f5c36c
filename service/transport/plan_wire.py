"""A plan as `loadplan.v1.LoadPlan` wire bytes, written directly: the answer of ResolveLoadPlan.

`plan_bytes(plan)` parses to exactly `client.convert.plan_to_pb(plan)` (tests/service/transport
check it on many plans), at a fraction of the cost of building the message and serializing it:
a single-process server pays for every answer's encoding under the GIL, and a plan is mostly
parts that every rank of a deployment shares (config text, runtime, deployment-wide decisions),
which are encoded once here and then copied as bytes.

The protobuf wire format is a concatenation of fields, each a tag (field number and wire type)
then its value; a length-delimited value (string, message) is preceded by its length as a
varint. proto3 leaves out scalar fields at their default ("", 0, false) and writes a message
field, even an empty one, whenever it is set. Fields go in number order, as protobuf writes them.
"""

from __future__ import annotations

import datetime as dt
from typing import Mapping

from ...client.convert import config_to_json, quantization_config_to_json, role_to_pb, timestamp, value_json
from ...plan import Decision, LoadPlan, Parallel, Runtime
from ..memo import ByIdentity, Memo, is_shared_view

_MIN_INT32, _MAX_INT32 = -2**31, 2**31 - 1
_UTC = dt.timezone.utc
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=_UTC)
_SMALL = [bytes((i,)) for i in range(128)]   # the varints of one byte


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _SMALL[n]
    if 0 < n < 16384:    # most lengths here (a decision, a reason)
        return bytes((n & 127 | 128, n >> 7))
    if n < 0:
        n += 1 << 64     # a negative int32: ten bytes of two's complement, as protobuf writes it
    out = bytearray()
    while n > 127:
        out.append(n & 127 | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


# Tags by field number (every field here is below 32): wire type 0 (varint) and 2 (length-delimited).
_VARINT_TAG = [_varint(n << 3) for n in range(32)]
_LEN_TAG = [_varint(n << 3 | 2) for n in range(32)]


def _text(number: int, value: str) -> bytes:
    """A string field; empty (the default) is left out."""
    if not value:
        return b""
    data = value.encode("utf-8")
    return _LEN_TAG[number] + _varint(len(data)) + data


def _message(number: int, body: bytes) -> bytes:
    """A set message field: written even when empty."""
    return _LEN_TAG[number] + _varint(len(body)) + body


def _int(number: int, value: int) -> bytes:
    """An int32 (or enum) field; 0 is left out, out of range is refused as the message refuses it."""
    if not value:
        return b""
    if not _MIN_INT32 <= value <= _MAX_INT32:
        raise ValueError(f"Value out of range: {value!r}")
    return _VARINT_TAG[number] + _varint(value)


def _bool(number: int, value: bool) -> bytes:
    return _VARINT_TAG[number] + b"\x01" if value else b""


# --- parts -----------------------------------------------------------------------------

def _parallel(p: Parallel) -> bytes:
    return _message(6, b"".join((_int(1, p.tp_size), _int(2, p.tp_rank), _int(3, p.ep_size), _int(4, p.ep_rank),
                                 _int(5, p.pp_size), _int(6, p.pp_rank), _int(7, p.dp_size), _int(8, p.dp_rank))))


def _runtime(rt: Runtime) -> bytes:
    return _message(11, b"".join((
        _text(1, rt.a2a_backend), _text(2, rt.device), _bool(4, rt.enable_sbo),
        _bool(5, rt.enable_tbo), _bool(6, rt.disable_shared_experts_fusion),
        _bool(7, rt.enforce_shared_experts_fusion), _bool(8, rt.enable_eplb),
        _int(9, rt.ep_num_redundant_experts), _text(10, rt.engine), _text(11, rt.engine_version),
        _text(12, rt.moe_runner_backend))))


def _timestamp_body(when: dt.datetime) -> bytes:
    """A Timestamp message's fields, as `client.convert.timestamp(when)` sets them."""
    if when.tzinfo is _UTC or when.tzinfo is None:
        # Its arithmetic for UTC (most times here), without building the message.
        delta = (when if when.tzinfo is _UTC else when.replace(tzinfo=_UTC)) - _EPOCH
        seconds, nanos = delta.days * 86400 + delta.seconds, delta.microseconds * 1000
    else:
        ts = timestamp(when)
        seconds, nanos = ts.seconds, ts.nanos
    return _seconds_field(seconds) + _int(2, nanos)


def _decision_body(d: Decision) -> bytes:
    """A Decision message's fields but decided_at (7, the last)."""
    return b"".join((_text(1, d.key), _text(2, value_json(d.value)), _text(3, d.reason), _text(4, d.rule),
                     _bool(5, d.deployment_wide), _int(6, d.revision)))


_parallel_field = ByIdentity(_parallel)
_shared_decision_body = ByIdentity(_decision_body)
# Plans made in the same second share their timestamps' seconds field.
_seconds_field = Memo(lambda seconds: _VARINT_TAG[1] + _varint(seconds) if seconds else b"", maxsize=64)
# Runs of fields that every plan of a deployment repeats, by their values (strings hash once
# per string object; Runtime is a frozen dataclass, shared by the transport between requests).
_ruleset_field = Memo(lambda version: _text(2, version), maxsize=64)
_deployment_fields = Memo(lambda key: b"".join((_text(8, key[0]), _text(9, key[1]), _text(10, key[2] or ""),
                                                  _runtime(key[3]))))
_config_fields = Memo(lambda key: b"".join((_text(16, key[0]), _text(17, key[1]), _text(18, key[2] or ""))),
                       maxsize=256)
_DECISION_TAG, _HISTORY_TAG = _LEN_TAG[12], _LEN_TAG[15]


class _DecisionRuns:
    """The decisions field (12, repeated) of every plan that carries one set of unstamped
    decisions: each decision's tag, length and body in key order, then its decided_at, which is
    the plan's own. By the stamp's length (a length prefix counts it), the runs between stamps
    are made once, and a plan's field is `at.join(runs)`: one copy, no per-decision work."""

    __slots__ = ("bodies", "runs")

    def __init__(self, unstamped: Mapping[str, Decision]):
        self.bodies = [_shared_decision_body(unstamped[key]) for key in sorted(unstamped)]
        self.runs: dict[int, list[bytes]] = {}

    def field(self, at: bytes) -> bytes:
        runs = self.runs.get(len(at))
        if runs is None:
            runs = self.runs[len(at)] = [_DECISION_TAG + _varint(len(b) + len(at)) + b for b in self.bodies] + [b""]
        return at.join(runs)


# By the identity of the rules cache's read-only views (`Resolution.decisions`, shared by every
# rank of a deployment stage), which nobody changes: a plain mapping is encoded decision by decision.
_decision_runs = ByIdentity(_DecisionRuns, maxsize=1024)


# --- the plan ----------------------------------------------------------------------------

def plan_bytes(plan: LoadPlan, *, config_json: str | None = None, quantization_config_json: str | None = None,
               unstamped: Mapping[str, Decision] | None = None) -> bytes:
    """`plan_to_pb(plan).SerializeToString()`, parsed alike.

    What the caller knows already saves encoding it again:
    - `config_json`, `quantization_config_json`: `config_to_json(plan.request.config)` and
      `quantization_config_to_json(plan.request.quantization_config)`, remembered by text;
    - `unstamped`: `plan.decisions` as they were before `decided_at=plan.created_at` was set on
      each (`Registry.new_plan`): objects that the rules cache shares between the plans of a
      deployment (its ranks' stages too), encoded once; the cache's read-only view of them
      (`Resolution.decisions`) is encoded once as a whole. A new plan (created, not replayed, no
      history) is then written by its `PlanTemplate`."""
    if unstamped is not None and plan.created_at is not None and not plan.replayed and not plan.history:
        return PlanTemplate(plan, config_json=config_json, quantization_config_json=quantization_config_json,
                            unstamped=unstamped).bytes(plan)
    req = plan.request
    # The times of one plan's decisions are mostly one (its creation): each encoded once.
    stamps: dict[dt.datetime, bytes] = {}

    def stamp(number: int, when: dt.datetime) -> bytes:
        body = stamps.get(when)
        if body is None:
            body = stamps[when] = _timestamp_body(when)
        return _message(number, body)

    out = [_text(1, plan.plan_id), _ruleset_field(plan.ruleset_version), _text(3, req.request_id),
           _text(4, req.deployment_id), _request_fields(plan)]
    for key in sorted(plan.decisions):
        d = plan.decisions[key]
        body = _decision_body(d) + (b"" if d.decided_at is None else stamp(7, d.decided_at))
        out += (_DECISION_TAG, _varint(len(body)), body)
    if plan.created_at is not None:
        out.append(stamp(13, plan.created_at))
    if plan.replayed:
        out.append(_bool(14, True))
    for d in plan.history:
        body = _decision_body(d) + (b"" if d.decided_at is None else stamp(7, d.decided_at))
        out += (_HISTORY_TAG, _varint(len(body)), body)
    out.append(_tail(plan, config_json, quantization_config_json))
    return b"".join(out)


def _request_fields(plan: LoadPlan) -> bytes:
    """Fields 5-11: the request's role, parallel, host, the plan's entry class, config fingerprint
    and quantization, the request's runtime."""
    req = plan.request
    return b"".join((_int(5, role_to_pb(req.role)), _parallel_field(req.parallel), _text(7, req.host),
                     _deployment_fields((plan.entry_class, plan.config_fingerprint, plan.quantization, req.runtime))))


def _tail(plan: LoadPlan, config_json: str | None, quantization_config_json: str | None) -> bytes:
    """Fields 16-18: the request's config texts (written as the store writes them) and its quantization."""
    req = plan.request
    if config_json is None:
        config_json = config_to_json(req.config)
    if quantization_config_json is None:
        quantization_config_json = quantization_config_to_json(req.quantization_config)
    return _config_fields((config_json, quantization_config_json, req.quantization))


class PlanTemplate:
    """`plan_bytes` of new plans that differ from one (`plan`, with its `unstamped` decisions)
    only in their plan id, request id, deployment id and creation time, their decisions decided
    then: what every plan of a request's shape shares (the ranks of one deployment repeat a few
    shapes, every deployment of a model the same ones) is encoded once, and a plan's answer is
    its four own fields joined to those runs (`bytes`)."""

    __slots__ = ("_ruleset", "_request", "_decisions", "_tail")

    def __init__(self, plan: LoadPlan, *, config_json: str | None = None,
                 quantization_config_json: str | None = None, unstamped: Mapping[str, Decision]):
        self._ruleset = _ruleset_field(plan.ruleset_version)
        self._request = _request_fields(plan)
        self._decisions = _decision_runs(unstamped) if is_shared_view(unstamped) else _DecisionRuns(unstamped)
        self._tail = _tail(plan, config_json, quantization_config_json)

    def bytes(self, plan: LoadPlan) -> bytes:
        """`plan`'s answer: a plan of this template's shape, created (not replayed, no history)."""
        req = plan.request
        created = _timestamp_body(plan.created_at)
        return b"".join((_text(1, plan.plan_id), self._ruleset, _text(3, req.request_id),
                         _text(4, req.deployment_id), self._request, self._decisions.field(_message(7, created)),
                         _message(13, created), self._tail))
