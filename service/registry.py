"""The registry's use cases, between the transport and the store.

Pure orchestration: validate and decide with the rules, then hand the plan to
the store, which writes it (or replays it, or refuses it) in one transaction.
No grpc and no sqlalchemy here: `PlanStore` is a protocol; `service.store`
implements it on SQLAlchemy and the tests use an in-memory fake.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from ..plan import Decision, LoadPlan, Parallel, PlanDiff, ResolveRequest, Runtime
from .errors import InvalidArgument
from .rules import RULESET_VERSION
from .rules.resolve import diff_deployment_inputs, fingerprint, resolve_decisions


@dataclass(frozen=True)
class PlanFilter:
    deployment_id: str | None = None
    role: str | None = None
    entry_class: str | None = None
    host: str | None = None
    created_after: dt.datetime | None = None    # inclusive
    created_before: dt.datetime | None = None   # exclusive


@dataclass(frozen=True)
class NewPlan:
    """Everything the store writes for one resolve, in one transaction."""

    plan: LoadPlan
    request_fingerprint: str                    # the whole request but its request id
    deployment_inputs: dict[str, Any]           # pinned by the first rank of (deployment, role)


class PlanStore(Protocol):
    def save_plan(self, new: NewPlan) -> LoadPlan:
        """Write `new` atomically and return the stored plan. In the same transaction:
        - request id already stored: same request_fingerprint -> that plan with replayed=True,
          nothing written; a different one -> FailedPrecondition;
        - pin (deployment_id, role) to new.deployment_inputs if not pinned yet; if pinned to
          different inputs -> FailedPrecondition naming the differing fields
          (`diff_deployment_inputs`), nothing written.
        Must hold under concurrent callers (many ranks at once) on every database."""

    def get_plan(self, plan_id: str, include_history: bool = False) -> LoadPlan:
        """NotFound when there is no such plan."""

    def list_plans(self, flt: PlanFilter, page_size: int, page_token: str | None) -> tuple[list[LoadPlan], str]:
        """Newest first; returns (plans, next_page_token or "")."""

    def append_decisions(self, request_id: str, plan_id: str, decisions: Sequence[Decision]) -> LoadPlan:
        """Each decision becomes the next revision of its key; idempotent by request_id."""

    def ready(self) -> bool:
        """The database answers and is migrated to head."""


MAX_PAGE_SIZE = 500
DEFAULT_PAGE_SIZE = 50


def request_fingerprint(req: ResolveRequest) -> str:
    # `asdict(req)` without its deep copy of the config (the hot path of every resolve): the
    # fields as they are, Parallel and Runtime (scalars only) as dicts. The same JSON, so the
    # same fingerprint; should the body hold something JSON cannot encode (a dataclass inside
    # the config), the plain `asdict` route decides.
    body = {f: getattr(req, f) for f in _REQUEST_FIELDS}
    body["parallel"] = {f: getattr(req.parallel, f) for f in _PARALLEL_FIELDS}
    body["runtime"] = {f: getattr(req.runtime, f) for f in _RUNTIME_FIELDS}
    try:
        return fingerprint(body)
    except TypeError:
        body = dataclasses.asdict(req)
        body.pop("request_id")
        return fingerprint(body)


_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(ResolveRequest) if f.name != "request_id")
_PARALLEL_FIELDS = tuple(f.name for f in dataclasses.fields(Parallel))
_RUNTIME_FIELDS = tuple(f.name for f in dataclasses.fields(Runtime))


def _stamped(d: Decision, at: dt.datetime) -> Decision:
    """`dataclasses.replace(d, decided_at=at)` at a fraction of its cost (a dozen per resolve)."""
    try:
        stamped = object.__new__(Decision)
        stamped.__dict__.update(d.__dict__, decided_at=at)
        return stamped
    except AttributeError:   # a Decision with __slots__: the general way
        return dataclasses.replace(d, decided_at=at)


class Registry:
    def __init__(self, store: PlanStore, clock=lambda: dt.datetime.now(dt.timezone.utc)):
        self.store = store
        self.clock = clock

    def resolve(self, req: ResolveRequest, inputs_key: Any = None) -> LoadPlan:
        """`inputs_key`: see `resolve_decisions` (the transport passes the raw JSON texts)."""
        res = resolve_decisions(req, inputs_key)
        now = self.clock()
        plan = LoadPlan(
            plan_id=uuid.uuid4().hex,
            ruleset_version=RULESET_VERSION,
            request=req,
            entry_class=res.entry_class,
            config_fingerprint=res.config_fingerprint,
            quantization=res.quantization,
            decisions={k: _stamped(v, now) for k, v in res.decisions.items()},
            created_at=now,
        )
        return self.store.save_plan(NewPlan(plan, request_fingerprint(req), res.deployment_inputs))

    def get_plan(self, plan_id: str, include_history: bool = False) -> LoadPlan:
        if not plan_id:
            raise InvalidArgument("plan_id", "required")
        return self.store.get_plan(plan_id, include_history)

    def list_plans(self, flt: PlanFilter, page_size: int = 0, page_token: str | None = None):
        if page_size < 0 or page_size > MAX_PAGE_SIZE:
            raise InvalidArgument("page_size", f"must be in [0, {MAX_PAGE_SIZE}], got {page_size}")
        if flt.created_after and flt.created_before and flt.created_after >= flt.created_before:
            raise InvalidArgument("created_after", "must be before created_before")
        return self.store.list_plans(flt, page_size or DEFAULT_PAGE_SIZE, page_token or None)

    def diff_plans(self, a_id: str, b_id: str) -> "PlanDiff":
        if not a_id:
            raise InvalidArgument("plan_a", "required")
        if not b_id:
            raise InvalidArgument("plan_b", "required")
        return diff_plans(self.store.get_plan(a_id), self.store.get_plan(b_id))

    def append_decisions(self, request_id: str, plan_id: str, decisions: Sequence[Decision]) -> LoadPlan:
        if not request_id:
            raise InvalidArgument("request_id", "required")
        if not decisions:
            raise InvalidArgument("decisions", "at least one decision")
        for i, d in enumerate(decisions):
            if not d.key:
                raise InvalidArgument(f"decisions[{i}].key", "required")
            if not d.rule:
                raise InvalidArgument(f"decisions[{i}].rule", "required")
        now = self.clock()
        return self.store.append_decisions(request_id, plan_id,
                                           [dataclasses.replace(d, decided_at=now) for d in decisions])


def _plan_inputs(p: LoadPlan) -> dict[str, Any]:
    req = p.request
    flat = {
        "deployment_id": req.deployment_id, "role": req.role, "host": req.host,
        "entry_class": p.entry_class, "config_fingerprint": p.config_fingerprint,
        "quantization": p.quantization, "ruleset_version": p.ruleset_version,
    }
    flat.update({f"parallel.{k}": v for k, v in dataclasses.asdict(req.parallel).items()})
    flat.update({f"runtime.{k}": v for k, v in dataclasses.asdict(req.runtime).items()})
    return flat


def diff_plans(a: LoadPlan, b: LoadPlan) -> PlanDiff:
    """The decisions whose value differs (or exist on one side only), and the differing inputs."""
    keys = sorted(a.decisions.keys() | b.decisions.keys())
    decisions = []
    for k in keys:
        da, db = a.decisions.get(k), b.decisions.get(k)
        if da is None or db is None or da.value != db.value:
            decisions.append((k, da, db))
    ia, ib = _plan_inputs(a), _plan_inputs(b)
    inputs = [(f, ia.get(f), ib.get(f)) for f in diff_deployment_inputs(ia, ib)]
    return PlanDiff(a, b, decisions, inputs)
