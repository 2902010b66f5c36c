"""Proto <-> domain for the service. Pure translation.

Plans go through the client's converter (one translation, both sides); here is
what only the service reads: requests, whose malformed parts become
INVALID_ARGUMENT naming the field, filters, diffs, backends and coverage.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from loadplan.client.convert import (WireError, datetime_of, decision_from_pb, decision_to_pb, parallel_to_pb,
                                     plan_from_pb, plan_to_pb, role_from_pb, role_to_pb, runtime_from_pb, timestamp,
                                     upgrade_to_pb)
from loadplan.errors import InvalidArgument
from loadplan.plan import Decision, LoadPlan, Parallel, ResolveRequest, Runtime
from loadplan.v1 import registry_pb2 as pb
from ..lru import LruCache
from ..registry import PlanDiff, PlanFilter
from ..rules.capabilities import BackendRow

__all__ = ["plan_to_pb", "plan_from_pb", "answer_to_pb", "request_from_pb", "filter_from_pb", "decisions_from_pb",
           "diff_to_pb", "backend_to_pb", "coverage_to_pb", "upgrade_to_pb"]


# Each distinct config text is parsed once while it is among the last this many: every rank of
# a deployment sends the same one, and its ranks share the parsed object, which nobody changes
# (the rules read it; the store and the answer encode it, `answer_to_pb` once per stage).
PARSED_CONFIGS = 256


@functools.lru_cache(maxsize=PARSED_CONFIGS)
def _json_object(text: str, field: str, *, required: bool) -> dict[str, Any] | None:
    """The JSON object `text` (a config.json), or None for "" when not `required`."""
    if not text:
        if required:
            raise InvalidArgument(field, "required (the checkpoint's config.json)")
        return None
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
    return value


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
        parallel=_parallel_unset_sizes_one(msg.parallel) if msg.HasField("parallel") else Parallel(),
        host=msg.host,
        config=_json_object(msg.config_json, "config_json", required=True),
        quantization_config=_json_object(msg.quantization_config_json, "quantization_config_json",
                                         required=False),
        quantization=msg.quantization or None,
        runtime=runtime_from_pb(msg.runtime) if msg.HasField("runtime") else Runtime(),
    )


def _parallel_unset_sizes_one(msg: pb.Parallelism) -> Parallel:
    """The client's `parallel_from_pb`, but a zero size read as 1 (proto3 cannot tell unset from 0).
    Built directly: `dataclasses.replace` over that one costs twice as much as the constructor."""
    return Parallel(tp_size=msg.tp_size or 1, tp_rank=msg.tp_rank, ep_size=msg.ep_size or 1, ep_rank=msg.ep_rank,
                    pp_size=msg.pp_size or 1, pp_rank=msg.pp_rank, dp_size=msg.dp_size or 1, dp_rank=msg.dp_rank)


# The answers' templates of the stages a fleet is resolving (see `answer_to_pb`).
_ANSWERS = LruCache(256)


def answer_to_pb(plan: LoadPlan) -> pb.LoadPlan:
    """`plan_to_pb(plan)` for a resolve's answer. What every rank of a pipeline stage shares
    (the rules' read-only decisions, the parsed configs `request_from_pb` hands out, the
    runtime as decided, the plan's scalars) is encoded once, by the client's `plan_to_pb`,
    into a template that each answer copies before writing its own fields: a dozen decisions
    built message by message were most of a resolve's encoding. tests/service/transport
    holds it equal to `plan_to_pb` field by field."""
    if plan.replayed or plan.history:   # read back from the store: nothing shared to reuse
        return plan_to_pb(plan)
    req = plan.request
    template, undated = _ANSWERS.of(
        (plan.decisions, req.config, req.quantization_config), lambda: _template(plan),
        req.runtime, req.quantization, plan.ruleset_version, plan.entry_class, plan.config_fingerprint,
        plan.quantization, plan.created_at is None)
    msg = pb.LoadPlan()
    msg.CopyFrom(template)
    # What is each rank's own (all of plan_to_pb's fields that the template's key does not settle):
    msg.plan_id = plan.plan_id
    msg.request_id = req.request_id
    msg.deployment_id = req.deployment_id
    msg.role = role_to_pb(req.role)
    msg.parallel.CopyFrom(parallel_to_pb(req.parallel))
    msg.host = req.host
    if plan.created_at is not None:
        created = timestamp(plan.created_at)
        msg.created_at.CopyFrom(created)
        for i in undated:
            msg.decisions[i].decided_at.CopyFrom(created)
    return msg


def _template(plan: LoadPlan) -> tuple[pb.LoadPlan, tuple[int, ...]]:
    """`plan_to_pb(plan)`, and the positions of its decisions stamped with the plan's time
    (without one of their own: `Decision.decided_at`), which each answer stamps with its own."""
    msg = plan_to_pb(plan)
    undated = tuple(i for i, (_, d) in enumerate(sorted(plan.decisions.items())) if d.decided_at is None)
    return msg, undated


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


def backend_to_pb(row: BackendRow) -> pb.Backend:
    return pb.Backend(name=row.name, forward_path=row.forward_path, combine_reduces=row.combine_reduces,
                      deepep_class=row.deepep_class, per_rank_fused_slots=row.per_rank_fused_slots,
                      fusion_force_disabled=row.fusion_force_disabled, accepted=row.accepted, note=row.note)


def capabilities_to_pb(report) -> pb.CapabilityReport:
    def candidate(c) -> pb.Candidate:
        return pb.Candidate(name=c.name, starts=c.starts, reason=c.reason, forward_path=c.forward_path,
                            shared_experts_fusion=c.shared_experts_fusion)
    return pb.CapabilityReport(engine=report.engine, engine_version=report.engine_version,
                               backends=[candidate(c) for c in report.backends],
                               moe_runners=[candidate(c) for c in report.moe_runners])


def coverage_to_pb(entry) -> pb.CoverageEntry:
    return pb.CoverageEntry(entry_class=entry.entry_class, known=entry.known, family=entry.family,
                            gated_family=entry.gated_family, has_gate=entry.has_gate, chain=list(entry.chain),
                            message=entry.message, ok=entry.ok)
