"""Proto <-> domain translation of plans, shared by the client and the service.

Pure translation, no validation beyond what the wire format forces: the service
wraps `WireError` into INVALID_ARGUMENT naming the field. Decision values travel
as JSON text (the proto explains why).

A plan on the wire carries the whole request it was made from (config.json
included), so a plan read back equals the plan the registry stored.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Iterable, Mapping

from google.protobuf.timestamp_pb2 import Timestamp

from ..plan import ROLE_SPECULATIVE, ROLE_TARGET, Decision, LoadPlan, Parallel, ResolveRequest, Runtime
from ..upgrade import DecisionChange, DeploymentUpgrade, RoleUpgrade, UpgradeReport
from ..v1 import registry_pb2 as pb


class WireError(ValueError):
    """A message that cannot be translated; `field` is its path in the request."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


_ROLE_TO_PB = {ROLE_TARGET: pb.ROLE_TARGET, ROLE_SPECULATIVE: pb.ROLE_SPECULATIVE}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_TO_PB.items()}


def role_to_pb(role: str | None) -> int:
    if role is None:
        return pb.ROLE_UNSPECIFIED
    try:
        return _ROLE_TO_PB[role]
    except KeyError:
        raise WireError("role", f"{role!r} is not a role; expected one of {', '.join(_ROLE_TO_PB)}") from None


def role_from_pb(value: int, default: str | None = ROLE_TARGET, field: str = "role") -> str | None:
    """ROLE_UNSPECIFIED (proto3's zero) means `default`."""
    if value == pb.ROLE_UNSPECIFIED:
        return default
    try:
        return _ROLE_FROM_PB[value]
    except KeyError:
        raise WireError(field, f"unknown role number {value}; expected one of {', '.join(_ROLE_TO_PB)}") from None


# --- time --------------------------------------------------------------------

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_UTC = dt.timezone.utc


def timestamp(when: dt.datetime) -> Timestamp:
    """Naive datetimes are taken as UTC."""
    if when.tzinfo is None or when.tzinfo is _UTC:
        # `Timestamp.FromDatetime`'s answer by datetime arithmetic, at a fraction of its cost
        # (a plan carries a dozen times): floor seconds, non-negative nanos, as it has them.
        delta = (when if when.tzinfo is _UTC else when.replace(tzinfo=_UTC)) - _EPOCH
        return Timestamp(seconds=delta.days * 86400 + delta.seconds, nanos=delta.microseconds * 1000)
    ts = Timestamp()
    ts.FromDatetime(when.astimezone(_UTC))
    return ts


def datetime_of(msg: Any, name: str) -> dt.datetime | None:
    """The timestamp field `name` of `msg` as an aware UTC datetime, None when unset."""
    if not msg.HasField(name):
        return None
    return getattr(msg, name).ToDatetime(tzinfo=dt.timezone.utc)


# --- parallelism and runtime ---------------------------------------------------

def parallel_to_pb(p: Parallel) -> pb.Parallelism:
    # On the wire a size of 0 is "unset" and means 1; a Parallel's sizes default to 1, so a 0
    # here was given on purpose (`--tp-size 0`) and is refused rather than sent as "unset".
    for name in ("tp_size", "ep_size", "pp_size", "dp_size"):
        if getattr(p, name) == 0:
            raise WireError(f"parallel.{name}", "must be >= 1, got 0")
    return pb.Parallelism(tp_size=p.tp_size, tp_rank=p.tp_rank, ep_size=p.ep_size, ep_rank=p.ep_rank,
                          pp_size=p.pp_size, pp_rank=p.pp_rank, dp_size=p.dp_size, dp_rank=p.dp_rank)


def parallel_from_pb(msg: pb.Parallelism) -> Parallel:
    """Taken literally: a zero size stays zero (the service refuses it by name)."""
    return Parallel(tp_size=msg.tp_size, tp_rank=msg.tp_rank, ep_size=msg.ep_size, ep_rank=msg.ep_rank,
                    pp_size=msg.pp_size, pp_rank=msg.pp_rank, dp_size=msg.dp_size, dp_rank=msg.dp_rank)


def runtime_to_pb(rt: Runtime) -> pb.Runtime:
    return pb.Runtime(
        a2a_backend=rt.a2a_backend, device=rt.device, engine=rt.engine, engine_version=rt.engine_version,
        moe_runner_backend=rt.moe_runner_backend,
        enable_sbo=rt.enable_sbo, enable_tbo=rt.enable_tbo,
        disable_shared_experts_fusion=rt.disable_shared_experts_fusion,
        enforce_shared_experts_fusion=rt.enforce_shared_experts_fusion,
        enable_eplb=rt.enable_eplb, ep_num_redundant_experts=rt.ep_num_redundant_experts,
        engine_args=dict(rt.engine_args), engine_env=dict(rt.engine_env), upgrade_from=rt.upgrade_from,
    )


_DEFAULT_RUNTIME = Runtime()


def runtime_from_pb(msg: pb.Runtime) -> Runtime:
    """Empty strings are proto3's "unset": the domain defaults apply (the proto says so)."""
    default = _DEFAULT_RUNTIME
    return Runtime(
        a2a_backend=msg.a2a_backend or default.a2a_backend,
        device=msg.device or default.device,
        engine=msg.engine, engine_version=msg.engine_version, moe_runner_backend=msg.moe_runner_backend,
        enable_sbo=msg.enable_sbo, enable_tbo=msg.enable_tbo,
        disable_shared_experts_fusion=msg.disable_shared_experts_fusion,
        enforce_shared_experts_fusion=msg.enforce_shared_experts_fusion,
        enable_eplb=msg.enable_eplb, ep_num_redundant_experts=msg.ep_num_redundant_experts,
        engine_args=dict(msg.engine_args), engine_env=dict(msg.engine_env), upgrade_from=msg.upgrade_from,
    )


# --- requests ------------------------------------------------------------------

def config_to_json(config: Any) -> str:
    return json.dumps(dict(config) if isinstance(config, Mapping) else config)


def quantization_config_to_json(qconfig: Any) -> str:
    """"" stands for "no quantization config"."""
    if qconfig is None:
        return ""
    return json.dumps(dict(qconfig) if isinstance(qconfig, Mapping) else qconfig)


def request_to_pb(req: ResolveRequest) -> pb.ResolveLoadPlanRequest:
    return pb.ResolveLoadPlanRequest(
        request_id=req.request_id,
        deployment_id=req.deployment_id,
        role=role_to_pb(req.role),
        parallel=parallel_to_pb(req.parallel),
        host=req.host,
        config_json=config_to_json(req.config),
        quantization_config_json=quantization_config_to_json(req.quantization_config),
        quantization=req.quantization or "",
        runtime=runtime_to_pb(req.runtime),
    )


# --- decisions and plans ----------------------------------------------------------

_json_string = json.encoder.encode_basestring_ascii   # what json.dumps writes for a str


def value_json(value: Any) -> str:
    """`json.dumps(value)`, with the scalars most decisions hold written directly."""
    cls = value.__class__
    if cls is bool:
        return "true" if value else "false"
    if cls is int:
        return int.__repr__(value)
    if cls is str:
        return _json_string(value)
    if value is None:
        return "null"
    if cls is float and value - value == 0.0:   # finite (json spells inf and nan its own way)
        return float.__repr__(value)
    if cls is list and all(v.__class__ is int for v in value):
        return f"[{', '.join(map(int.__repr__, value))}]"
    return json.dumps(value)


def decision_to_pb(d: Decision, decided_at: Timestamp | None = None) -> pb.Decision:
    """`decided_at`: `d`'s time, made already by the caller (a plan's decisions mostly share
    its created_at; a new plan's have no time of their own: `Decision.decided_at`)."""
    if decided_at is None and d.decided_at is not None:
        decided_at = timestamp(d.decided_at)
    return pb.Decision(key=d.key, value_json=value_json(d.value), reason=d.reason, rule=d.rule,
                       deployment_wide=d.deployment_wide, revision=d.revision, decided_at=decided_at)


def decision_from_pb(msg: pb.Decision, field: str = "decision") -> Decision:
    try:
        value = json.loads(msg.value_json) if msg.value_json else None
    except (ValueError, RecursionError) as e:
        raise WireError(f"{field}.value_json", f"not valid JSON ({type(e).__name__}: {e})") from None
    return Decision(key=msg.key, value=value, reason=msg.reason, rule=msg.rule,
                    deployment_wide=msg.deployment_wide, revision=msg.revision,
                    decided_at=datetime_of(msg, "decided_at"))


def plan_to_pb(plan: LoadPlan) -> pb.LoadPlan:
    req = plan.request
    created = None if plan.created_at is None else timestamp(plan.created_at)

    def at(d: Decision) -> Timestamp | None:
        return created if d.decided_at is None or d.decided_at == plan.created_at else None

    return pb.LoadPlan(
        plan_id=plan.plan_id,
        ruleset_version=plan.ruleset_version,
        request_id=req.request_id,
        deployment_id=req.deployment_id,
        role=role_to_pb(req.role),
        parallel=parallel_to_pb(req.parallel),
        host=req.host,
        entry_class=plan.entry_class,
        config_fingerprint=plan.config_fingerprint,
        quantization=plan.quantization or "",
        runtime=runtime_to_pb(req.runtime),
        decisions=[decision_to_pb(d, at(d)) for _, d in sorted(plan.decisions.items())],
        created_at=created,
        replayed=plan.replayed,
        history=[decision_to_pb(d, at(d)) for d in plan.history],
        config_json=config_to_json(req.config),
        quantization_config_json=quantization_config_to_json(req.quantization_config),
        requested_quantization=req.quantization or "",
    )


def plan_from_pb(msg: pb.LoadPlan) -> LoadPlan:
    request = ResolveRequest(
        request_id=msg.request_id,
        deployment_id=msg.deployment_id,
        role=role_from_pb(msg.role),
        parallel=parallel_from_pb(msg.parallel),
        host=msg.host,
        config=json.loads(msg.config_json) if msg.config_json else {},
        quantization_config=json.loads(msg.quantization_config_json) if msg.quantization_config_json else None,
        quantization=msg.requested_quantization or None,
        runtime=runtime_from_pb(msg.runtime),
    )
    return LoadPlan(
        plan_id=msg.plan_id,
        ruleset_version=msg.ruleset_version,
        request=request,
        entry_class=msg.entry_class,
        config_fingerprint=msg.config_fingerprint,
        quantization=msg.quantization or None,
        decisions={d.key: decision_from_pb(d) for d in msg.decisions},
        created_at=datetime_of(msg, "created_at"),
        replayed=msg.replayed,
        history=tuple(decision_from_pb(d) for d in msg.history),
    )


def decisions_to_pb(decisions: Iterable[Decision]) -> list[pb.Decision]:
    return [decision_to_pb(d) for d in decisions]


# --- upgrade checks (loadplan/upgrade.py): one translation, both sides ---------------------------------------------

def upgrade_to_pb(report: UpgradeReport) -> pb.UpgradeReport:
    reply = pb.UpgradeReport(engine=report.engine, to_version=report.to_version, from_version=report.from_version,
                             blocked=report.blocked)
    for d in report.deployments:
        dep = reply.deployments.add(deployment_id=d.deployment_id, from_versions=list(d.from_versions),
                                    status=d.status)
        for r in d.roles:
            role = dep.roles.add(role=role_to_pb(r.role), runners=r.runners, refusal=r.refusal,
                                 refused_runners=r.refused_runners, hazard=r.hazard)
            for c in r.changes:
                change = role.changes.add(key=c.key, has_before=c.before is not None, has_after=c.after is not None,
                                          runners=c.runners)
                if c.before is not None:
                    change.before.CopyFrom(decision_to_pb(c.before))
                if c.after is not None:
                    change.after.CopyFrom(decision_to_pb(c.after))
    return reply


def upgrade_from_pb(msg: pb.UpgradeReport) -> UpgradeReport:
    return UpgradeReport(msg.engine, msg.to_version, msg.from_version, tuple(
        DeploymentUpgrade(d.deployment_id, tuple(d.from_versions), tuple(
            RoleUpgrade(role_from_pb(r.role), r.runners, tuple(
                DecisionChange(c.key, decision_from_pb(c.before) if c.has_before else None,
                               decision_from_pb(c.after) if c.has_after else None, c.runners)
                for c in r.changes), r.refusal, r.refused_runners, r.hazard)
            for r in d.roles))
        for d in msg.deployments))
