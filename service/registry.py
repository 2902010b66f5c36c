"""The registry's use cases, between the transport and the store.

Pure orchestration: validate and decide with the rules, then hand the plan to
the store, which writes it (or replays it, or refuses it) in one transaction.
No grpc and no sqlalchemy here: `PlanStore` is a protocol; `service.store`
implements it on SQLAlchemy and the tests use an in-memory fake.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import operator
import os
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from ..plan import Decision, LoadPlan, Parallel, PlanDiff, ResolveRequest, Runtime
from .errors import InvalidArgument
from .memo import ByIdentity
from .rules import RULESET_VERSION
from .rules.resolve import check_ids, diff_deployment_inputs, fingerprint, resolve_decisions


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
    # The request's config and quantization config as the store writes them (`client.convert.
    # config_to_json` / `quantization_config_to_json` of plan.request): computed once per distinct
    # config by the caller when it can; None: the store encodes them itself.
    config_json: str | None = None
    quantization_config_json: str | None = None
    # plan.decisions as the rules made them, before `decided_at=plan.created_at` was set on each:
    # objects the rules cache shares between the plans of a deployment, so a store or transport
    # may encode them once (by identity) for every plan that carries them. None: unknown.
    unstamped: Mapping[str, Decision] | None = None
    # The plan this one was made like (`Registry.new_plan_like`): equal to it but for the plan id,
    # request id, deployment id, request fingerprint and creation time, so a store may reuse what it
    # encoded of that one (its row's other values). None: made from scratch.
    like: NewPlan | None = None


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


def request_fingerprint(req: ResolveRequest, config_fingerprint: str | None = None,
                        quantization_config_fingerprint: str | None = None) -> str:
    """sha256 of everything in `req` but its request id: equal for requests equal up to
    request_id, different otherwise (configs compared as `fingerprint` compares them: up to
    key order).

    The configs enter through their own fingerprints, which the rules compute once per
    deployment (`Resolution.deployment_inputs`), so a resolve does not encode the whole config
    again: pass them when known (`fingerprint(dict(config))` of `req`'s configs); None computes
    them here. The other fields enter as they are, every field of the dataclasses (so a field
    added later is covered without touching this)."""
    return hashlib.sha256(_fingerprint_text(req, config_fingerprint, quantization_config_fingerprint).encode()
                          ).hexdigest()


def _fingerprint_text(req: ResolveRequest, config_fingerprint: str | None,
                      quantization_config_fingerprint: str | None) -> str:
    """What `request_fingerprint` hashes."""
    if config_fingerprint is None:
        config_fingerprint = fingerprint(dict(req.config))
    if req.quantization_config is None:
        # Not `fingerprint({})`: no quantization config and an empty one are different requests
        # (the deployment inputs treat them alike, a different question).
        quantization_config_fingerprint = None
    elif quantization_config_fingerprint is None:
        quantization_config_fingerprint = fingerprint(dict(req.quantization_config))
    # The text is repr(("request/2", config_fingerprint, quantization_config_fingerprint,
    # _request_scalars(req), _parallel_fields(req.parallel), _runtime_fields(req.runtime))): repr, not
    # JSON (twice the cost), of strings, integers, booleans and None, whose repr is their literal, so
    # different bodies have different texts. It is written here part by part, as repr writes a tuple of
    # several items, with the reprs of the Parallel and Runtime remembered by identity (frozen values
    # the transport shares between requests): the same text at half the cost.
    return (f"('request/2', {config_fingerprint!r}, {quantization_config_fingerprint!r}, "
            f"{_request_scalars(req)!r}, {_parallel_repr(req.parallel)}, {_runtime_repr(req.runtime)})")


_request_scalars = operator.attrgetter(*(f.name for f in dataclasses.fields(ResolveRequest) if f.name not in
                                         ("request_id", "parallel", "runtime", "config", "quantization_config")))
_parallel_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(Parallel)))
_runtime_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(Runtime)))
assert _request_scalars.__reduce__()[1][0] == "deployment_id", "new_plan_like's fingerprint splices it in first"
# Each a tuple of several fields (repr writes a 1-tuple otherwise: "(x,)").
assert min(len(dataclasses.fields(ResolveRequest)) - 5, len(dataclasses.fields(Parallel)),
           len(dataclasses.fields(Runtime))) > 1
_parallel_repr = ByIdentity(lambda p: repr(_parallel_fields(p)), maxsize=1024)
_runtime_repr = ByIdentity(lambda rt: repr(_runtime_fields(rt)), maxsize=1024)


@ByIdentity
def _fingerprint_around_deployment(first: NewPlan) -> tuple[Any, str]:
    """For the plans made like `first` (`Registry.new_plan_like`): the text `request_fingerprint`
    hashes for `first`'s request is split at its deployment id, the first of the request's scalars
    (the request id is not in it): sha256 of what is before it, to copy, and the text after it."""
    inputs = first.deployment_inputs
    marker = "\x00deployment\x00"   # not an id (ids are checked): cannot occur in the text otherwise
    text = _fingerprint_text(_with(first.plan.request, deployment_id=marker), inputs["config_fingerprint"],
                             inputs["quantization_config_fingerprint"])
    before, after = text.split(repr(marker))
    return hashlib.sha256(before.encode()), after


def _stamp(decisions: Mapping[str, Decision], at: dt.datetime) -> dict[str, Decision]:
    """`{k: dataclasses.replace(d, decided_at=at)}` at a fraction of its cost (a dozen per
    resolve): each decision's fields copied with `at` in place, without `__init__` (the fields
    were checked when the decision was made)."""
    stamped = {}
    for k, d in decisions.items():
        copy = _new(Decision)
        fields = copy.__dict__
        fields.update(d.__dict__)
        fields["decided_at"] = at
        stamped[k] = copy
    return stamped


_new = object.__new__
assert not hasattr(Decision, "__slots__"), "_stamp copies a Decision's __dict__"


class StampedDecisions(Mapping[str, Decision]):
    """A new plan's decisions (`LoadPlan.decisions`): the rules' `unstamped` ones, each decided at
    `at` (the plan's creation), the stamped copies made when first read (`_stamp`). The server
    encodes a plan from `NewPlan.unstamped` (the store's row, the answer's bytes) and never reads
    them: copying a dozen decisions for every resolve was a tenth of what the registry spends on
    one beyond a bare RPC. Reads like the dict it stands for; copies and pickles as that dict
    (`dataclasses.asdict` keeps its Decision objects, as for any mapping that is not a dict)."""

    __slots__ = ("unstamped", "at", "_stamped")

    def __init__(self, unstamped: Mapping[str, Decision], at: dt.datetime):
        self.unstamped = unstamped
        self.at = at
        self._stamped: dict[str, Decision] | None = None

    def _dict(self) -> dict[str, Decision]:
        stamped = self._stamped
        if stamped is None:
            stamped = self._stamped = _stamp(self.unstamped, self.at)
        return stamped

    def __getitem__(self, key: str) -> Decision:
        return self._dict()[key]

    def __iter__(self):
        return iter(self.unstamped)

    def __len__(self) -> int:
        return len(self.unstamped)

    def __contains__(self, key: object) -> bool:
        return key in self.unstamped

    def keys(self):
        return self._dict().keys()

    def items(self):
        return self._dict().items()

    def values(self):
        return self._dict().values()

    def get(self, key: str, default: Any = None) -> Any:
        return self._dict().get(key, default)

    def __eq__(self, other: object) -> bool:
        return self._dict() == (other._dict() if isinstance(other, StampedDecisions) else other)

    __hash__ = None   # as a dict's

    def __repr__(self) -> str:
        return repr(self._dict())

    def __reduce__(self):
        return dict, (self._dict(),)


def _with(value: Any, **fields: Any) -> Any:
    """`dataclasses.replace(value, **fields)` of a frozen dataclass whose other fields were checked
    already, without `__init__` (a resolve makes two)."""
    copy = _new(value.__class__)
    copy.__dict__.update(value.__dict__, **fields)
    return copy


assert not hasattr(LoadPlan, "__slots__") and not hasattr(ResolveRequest, "__slots__"), "_with copies __dict__"


def new_plan_id() -> str:
    """`uuid.uuid4().hex` without building the UUID (a third of the cost, every resolve): 122
    random bits with the version (4) and variant (RFC 4122) bits of a random UUID."""
    n = int.from_bytes(os.urandom(16), "big")
    return f"{n & ~(0xF000 << 64) & ~(0xC000 << 48) | 0x4000 << 64 | 0x8000 << 48:032x}"


@dataclass(frozen=True)
class Resolved:
    """A resolve's outcome with what a transport may reuse to encode it (`Registry.resolve_new`)."""

    plan: LoadPlan                      # what the store answered: `new.plan`, or a stored plan (replayed)
    new: NewPlan                        # what was handed to the store (`new.unstamped` included)


class Registry:
    def __init__(self, store: PlanStore, clock=lambda: dt.datetime.now(dt.timezone.utc)):
        self.store = store
        self.clock = clock

    def resolve(self, req: ResolveRequest, inputs_key: Any = None) -> LoadPlan:
        """`inputs_key`: see `resolve_decisions` (the transport passes the raw JSON texts)."""
        return self.resolve_new(req, inputs_key).plan

    def resolve_new(self, req: ResolveRequest, inputs_key: Any = None,
                    config_texts: tuple[str, str | None] | None = None) -> Resolved:
        """`resolve`, answering with what was saved too. `config_texts`: `NewPlan.config_json` and
        `quantization_config_json` when the caller has them (the transport keeps them per config
        text): the texts `client.convert.config_to_json(req.config)` and
        `quantization_config_to_json(req.quantization_config)` write."""
        new = self.new_plan(req, inputs_key, config_texts)
        return Resolved(self.store.save_plan(new), new)

    def new_plan(self, req: ResolveRequest, inputs_key: Any = None,
                 config_texts: tuple[str, str | None] | None = None) -> NewPlan:
        """Validate and decide (no store involved): the plan to save."""
        res = resolve_decisions(req, inputs_key)
        req = res.request   # the runtime names the engine that decided
        now = self.clock()
        plan = LoadPlan(
            plan_id=new_plan_id(),
            ruleset_version=RULESET_VERSION,
            request=req,
            entry_class=res.entry_class,
            config_fingerprint=res.config_fingerprint,
            quantization=res.quantization,
            decisions=StampedDecisions(res.decisions, now),
            created_at=now,
        )
        inputs = res.deployment_inputs
        fp = request_fingerprint(req, inputs["config_fingerprint"], inputs["quantization_config_fingerprint"])
        config_json, quantization_config_json = config_texts or (None, None)
        return NewPlan(plan, fp, inputs, config_json, quantization_config_json, res.decisions)

    def new_plan_like(self, first: NewPlan, request_id: str, deployment_id: str) -> NewPlan:
        """`new_plan` of a request equal to `first.plan.request` but for its two ids: what
        `new_plan` makes of it, without deciding again. The rules read neither id but to check
        it (tests/service/test_registry.py holds the two ways equal), so `first`'s decisions,
        inputs and config texts are this request's too; the ids are checked here, the plan gets
        its own id and time. `first`: a `new_plan` result (`unstamped` set)."""
        check_ids(request_id, deployment_id)
        req = _with(first.plan.request, request_id=request_id, deployment_id=deployment_id)
        now = self.clock()
        plan = _with(first.plan, plan_id=new_plan_id(), request=req,
                     decisions=StampedDecisions(first.unstamped, now), created_at=now)
        prefix, suffix = _fingerprint_around_deployment(first)
        fp = prefix.copy()
        fp.update(f"{deployment_id!r}{suffix}".encode())
        return NewPlan(plan, fp.hexdigest(), first.deployment_inputs, first.config_json,
                       first.quantization_config_json, first.unstamped, like=first)

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
