"""The registry's use cases, between the transport and the store.

Pure orchestration: validate and decide with the rules, then hand the plan to
the store, which writes it (or replays it, or refuses it) in one transaction.
No grpc and no sqlalchemy here: `PlanStore` is a protocol; `service.store`
implements it on SQLAlchemy and the tests use an in-memory fake.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import operator
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Hashable, Mapping, Protocol, Sequence

from loadplan.errors import InvalidArgument
from loadplan.plan import Decision, LoadPlan, Parallel, PlanDiff, ResolveRequest, Runtime
from loadplan.upgrade import UpgradeReport
from .rules import RULESET_VERSION
from .rules.capabilities import backends_of, starts_with
from .rules.observed import observed_decisions
from .rules.resolve import diff_deployment_inputs, fingerprint, resolve_decisions
from .upgrade_check import check_upgrade


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
    deployment_inputs: Mapping[str, Any]        # pinned by the first rank of (deployment, role)


class PlanStore(Protocol):
    def save_plan(self, new: NewPlan) -> LoadPlan:
        """Write `new` atomically and return the stored plan. In the same transaction:
        - request id already stored: same request_fingerprint -> that plan with replayed=True,
          nothing written; a different one -> FailedPrecondition;
        - pin (deployment_id, role) to new.deployment_inputs if not pinned yet; if pinned to
          different inputs -> FailedPrecondition naming the differing fields
          (`diff_deployment_inputs`), nothing written.
        Must hold under concurrent callers (many ranks at once) on every database."""

    def save_batch(self, news: Sequence[NewPlan]) -> list[LoadPlan | Exception]:
        """`save_plan` of each, in ONE transaction: one outcome per plan, in order (the stored
        plan, or the refusal as an exception), the same as saving them one after the other.
        Raises (Unavailable) only when nothing of the batch was written."""

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


def request_fingerprint(req: ResolveRequest, config_fingerprint: str | None = None,
                        quantization_config_fingerprint: str | None = None) -> str:
    """sha256 of everything in `req` but its request id: equal for requests equal up to
    request_id, different otherwise (configs compared as `fingerprint` compares them: up to
    key order). The configs' fingerprints, when the rules computed them already, may be passed.

    The hashed text is the repr of a tuple of strings, integers, booleans and None (whose repr
    is their literal, so different requests have different texts); it is stored with each plan,
    so it must not change for an unchanged request (a retry after an upgrade still replays)."""
    if config_fingerprint is None:
        config_fingerprint = fingerprint(dict(req.config))
    if req.quantization_config is None:
        # Not `fingerprint({})`: no quantization config and an empty one are different requests.
        quantization_config_fingerprint = None
    elif quantization_config_fingerprint is None:
        quantization_config_fingerprint = fingerprint(dict(req.quantization_config))
    rt = req.runtime
    body = ("request/2", config_fingerprint, quantization_config_fingerprint, _request_scalars(req),
            _parallel_fields(req.parallel), _runtime_fields(rt))
    if rt.engine_args or rt.engine_env or rt.upgrade_from:
        # Appended only when sent (text, and tuples of text pairs, whose repr is literal too): a request without
        # them hashes the text it always did.
        body += (rt.engine_args, rt.engine_env) + ((rt.upgrade_from,) if rt.upgrade_from else ())
    return hashlib.sha256(repr(body).encode()).hexdigest()


# Every field of the dataclasses, so that a field added later is in the fingerprint without touching this.
_request_scalars = operator.attrgetter(*(f.name for f in dataclasses.fields(ResolveRequest) if f.name not in
                                         ("request_id", "parallel", "runtime", "config", "quantization_config")))
_parallel_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(Parallel)))
# The runtime's scalars (engine_args and engine_env, pairs of text, are appended after them when sent).
_runtime_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(Runtime)
                                        if f.name not in ("engine_args", "engine_env", "upgrade_from")))


class Registry:
    """`save`: how `resolve_async` saves a plan (the server's group commit,
    service/store/group_commit.py); None: the store's `save_plan` on a worker thread."""

    def __init__(self, store: PlanStore, clock=lambda: dt.datetime.now(dt.timezone.utc), *,
                 save: Callable[[NewPlan], Awaitable[LoadPlan]] | None = None):
        self.store = store
        self.clock = clock
        self._save = save

    def resolve(self, req: ResolveRequest, inputs_key: Hashable | None = None) -> LoadPlan:
        """Validate, decide and save. `inputs_key`: see `rules.resolve.resolve_decisions` (a
        caller that has the configs' raw texts passes them, so the deployment-wide part is
        decided once per deployment)."""
        return self.store.save_plan(self.new_plan(req, inputs_key)).dated()

    async def resolve_async(self, req: ResolveRequest, inputs_key: Hashable | None = None) -> LoadPlan:
        """`resolve` for a coroutine: the rules run on the caller's loop (pure CPU), the save is awaited.
        A new plan comes back as decided, its decisions without a time of their own (its
        created_at, `Decision.decided_at`): the transport sends them with it."""
        new = self.new_plan(req, inputs_key)
        if self._save is not None:
            return await self._save(new)
        return await asyncio.to_thread(self.store.save_plan, new)

    def list_backends(self, engine: str = "", version: str = ""):
        """(engine, release, its a2a backend table) as that engine spells them (rules/capabilities.py)."""
        return backends_of(engine, version)

    def check_capabilities(self, req: ResolveRequest):
        """Which backends and MoE runners `req`'s engine would start `req`'s runner with, and why not the others
        (rules/capabilities.py: starts_with; nothing is written)."""
        return starts_with(req, resolve_decisions)

    def record_observed(self, req: ResolveRequest, observed: Sequence[Decision]) -> LoadPlan:
        """Save what an engine release without a profile decided (service/rules/observed.py), as a plan."""
        by_key = {}
        for i, d in enumerate(observed):
            if not d.key:
                raise InvalidArgument(f"decisions[{i}].key", "required")
            if d.key in by_key:
                raise InvalidArgument(f"decisions[{i}].key", f"{d.key!r} twice")
            by_key[d.key] = d
        if not by_key:
            raise InvalidArgument("decisions", "at least one decision the engine made")
        return self.store.save_plan(self._new_plan(observed_decisions(req, by_key))).dated()

    def new_plan(self, req: ResolveRequest, inputs_key: Hashable | None = None) -> NewPlan:
        """Validate and decide (no store involved): the plan to save."""
        return self._new_plan(resolve_decisions(req, inputs_key))

    def _new_plan(self, res) -> NewPlan:
        req = res.request   # the runtime names the engine that decided
        now = self.clock()
        plan = LoadPlan(
            plan_id=uuid.uuid4().hex,
            ruleset_version=RULESET_VERSION,
            request=req,
            entry_class=res.entry_class,
            config_fingerprint=res.config_fingerprint,
            quantization=res.quantization,
            # The rules' shared read-only view, as decided: revision 0 without a time, which
            # is the plan's created_at (`Decision.decided_at`); not copied to stamp each one.
            decisions=res.decisions,
            created_at=now,
        )
        inputs = res.deployment_inputs
        fp = request_fingerprint(req, inputs["config_fingerprint"], inputs["quantization_config_fingerprint"])
        return NewPlan(plan, fp, inputs)

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

    def diff_plans(self, a_id: str, b_id: str) -> PlanDiff:
        if not a_id:
            raise InvalidArgument("plan_a", "required")
        if not b_id:
            raise InvalidArgument("plan_b", "required")
        return diff_plans(self.store.get_plan(a_id), self.store.get_plan(b_id))

    def upgrade_check(self, engine: str, to_version: str, from_version: str = "",
                      deployment_id: str | None = None) -> UpgradeReport:
        """What every stored deployment of `engine` (or the one named) would be planned under `to_version`."""
        if not engine:
            raise InvalidArgument("engine", "required")
        if not to_version:
            raise InvalidArgument("to_version", "required")
        return check_upgrade(self._every_plan(PlanFilter(deployment_id=deployment_id or None)), engine, to_version,
                             from_version)

    def _every_plan(self, flt: PlanFilter):
        token = None
        while True:
            plans, token = self.store.list_plans(flt, MAX_PAGE_SIZE, token)
            yield from plans
            if not token:
                return

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
