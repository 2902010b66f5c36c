"""`SqlPlanStore`: the `PlanStore` protocol of service/registry.py on SQLAlchemy 2.

Every call is one transaction, so a failed call leaves nothing behind (DESIGN 6, 7).
`save_batch(plans)` writes several plans in ONE transaction (one COMMIT, one WAL flush
for all), each with its own outcome, the same as saving them one after the other:
refusals (a reused request id, inputs that differ from the deployment's pin) are
decided before anything is written, so they fail their plan only. The server's group
commit (group_commit.py) is a thin asyncio wrapper over it; `save_plan` is a batch of one.

Concurrency (many ranks of one deployment at once, several registry replicas):
- SQLite: write transactions BEGIN IMMEDIATE (db.py), so writers run one at a time
  and every look-up sees every committed row.
- PostgreSQL (READ COMMITTED): the unique keys arbitrate. Pins are inserted with
  ON CONFLICT DO NOTHING (which waits for a concurrent inserter of the same pin and
  then yields to the winner); a pin lost to another writer is read back and checked;
  a request id stored by another writer meanwhile is a unique violation. Either way
  the transaction starts over and then replays or refuses what it must. Rows are
  inserted in key order, so concurrent batches take their locks in one order.
A plan is ONE row: its resolved decisions are a JSON column (`decisions_json`,
migration 0002); `decisions` rows hold the revisions AppendDecisions adds.
Connection errors become `errors.Unavailable` (the client retries with the same
request id, which is safe because of the above).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import datetime as dt
import functools
import json
from types import MappingProxyType
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine, Row

from loadplan.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from loadplan.plan import Decision, LoadPlan, Parallel, ResolveRequest, Runtime
from ..lru import LruCache
from ..registry import NewPlan, PlanFilter
from ..rules.resolve import diff_deployment_inputs, fingerprint
from .db import is_at_head, writer
from .models import DecisionAppendRow, DecisionRow, DeploymentPinRow, PlanRow

PLANS: sa.Table = PlanRow.__table__
DECISIONS: sa.Table = DecisionRow.__table__
PINS: sa.Table = DeploymentPinRow.__table__
APPENDS: sa.Table = DecisionAppendRow.__table__

# A transaction that lost a race (concurrent duplicate request id or pin, PostgreSQL deadlock
# or serialization failure) starts over this many times before giving up as UNAVAILABLE.
MAX_ATTEMPTS = 5
# SQLSTATEs worth retrying in place: serialization_failure, deadlock_detected.
_RETRY_SQLSTATES = {"40001", "40P01"}
LOOKUP_CHUNK = 400   # keys per IN (...) look-up
# Committed pins this process has seen, kept so that a rank of a known deployment is checked
# without a look-up: a pin never changes once committed (nothing updates or deletes one).
PIN_CACHE_SIZE = 4096


class Pin(NamedTuple):
    """A deployment pin: the plan that set it and the deployment-wide inputs it holds."""
    plan_id: str
    inputs_json: str


class _Retry(Exception):
    """Internal: the transaction lost a race; run it again."""


# --- errors ---------------------------------------------------------------------------

def _sqlstate(err: BaseException) -> str | None:
    orig = getattr(err, "orig", None) or err
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


def _is_unique_violation(err: sa_exc.IntegrityError) -> bool:
    return _sqlstate(err) == "23505" or "UNIQUE constraint failed" in str(err.orig)


def _is_missing_table(err: sa_exc.DBAPIError) -> bool:
    # An unmigrated database is not ready, like an unreachable one (health says NOT_SERVING).
    return _sqlstate(err) == "42P01" or "no such table" in str(err.orig)


def _is_unavailable(err: sa_exc.DBAPIError) -> bool:
    return (isinstance(err, (sa_exc.OperationalError, sa_exc.InterfaceError))
            or bool(err.connection_invalidated))


def _short(err: BaseException) -> str:
    orig = getattr(err, "orig", None) or err
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0][:300]


@contextlib.contextmanager
def _translate_errors(what: str) -> Iterator[None]:
    """Database-unreachable errors -> Unavailable; lost races -> _Retry; the rest unchanged."""
    try:
        yield
    except sa_exc.IntegrityError as err:
        if _is_unique_violation(err):
            raise _Retry() from err
        raise
    except sa_exc.TimeoutError as err:   # no pooled connection came free in time
        raise Unavailable(f"database unavailable while {what}: {_short(err)}; retry with the same request id") \
            from err
    except sa_exc.DBAPIError as err:
        if _sqlstate(err) in _RETRY_SQLSTATES:
            raise _Retry() from err
        if _is_missing_table(err):
            raise Unavailable(f"database not migrated while {what}: {_short(err)}; run `loadplan migrate --db URL`") \
                from err
        if _is_unavailable(err):
            raise Unavailable(f"database unavailable while {what}: {_short(err)}; retry with the same request id") \
                from err
        raise


def _utc(value: dt.datetime, field: str) -> dt.datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgument(field, f"{value.isoformat()} has no time zone; pass an aware (UTC) time")
    return value.astimezone(dt.timezone.utc)


# --- page tokens: opaque to clients, base64url of the last row's keyset position --------

def encode_page_token(created_at: dt.datetime, plan_id: str) -> str:
    body = json.dumps({"t": created_at.astimezone(dt.timezone.utc).isoformat(), "p": plan_id},
                      separators=(",", ":"))
    return base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


def decode_page_token(token: str) -> tuple[dt.datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        body = json.loads(raw.decode())
        created_at = dt.datetime.fromisoformat(body["t"])
        plan_id = body["p"]
        if not isinstance(plan_id, str) or created_at.tzinfo is None:
            raise ValueError("bad fields")
    except (binascii.Error, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise InvalidArgument("page_token", "malformed; pass the next_page_token of a previous answer "
                                            "unchanged, or none for the first page") from None
    return created_at.astimezone(dt.timezone.utc), plan_id


# --- rows <-> domain --------------------------------------------------------------------

def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


_PARALLEL_FIELDS = tuple(f.name for f in dataclasses.fields(Parallel))
_RUNTIME_FIELDS = tuple(f.name for f in dataclasses.fields(Runtime))


def _fields_of(value: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """`dataclasses.asdict` of a dataclass of scalars, at a tenth of its cost (it copies recursively)."""
    return {name: getattr(value, name) for name in names}


def _plan_row(new: NewPlan) -> dict[str, Any]:
    """The plan's row: everything its request is rebuilt from, and its resolved decisions."""
    plan = new.plan
    req = plan.request
    return dict(
        plan_id=plan.plan_id, request_id=req.request_id, request_fingerprint=new.request_fingerprint,
        deployment_id=req.deployment_id, role=req.role, host=req.host,
        **_fields_of(req.parallel, _PARALLEL_FIELDS),
        entry_class=plan.entry_class, config_fingerprint=plan.config_fingerprint,
        config_json=_dumps(dict(req.config)), quantization=plan.quantization, requested_quantization=req.quantization,
        quantization_config_json=None if req.quantization_config is None else _dumps(dict(req.quantization_config)),
        runtime_json=_runtime_json(req.runtime), ruleset_version=plan.ruleset_version,
        created_at=plan.created_at, decisions_json=_decisions_json(plan))


@functools.lru_cache(maxsize=256)
def _runtime_json(runtime: Runtime) -> str:
    return _dumps(_fields_of(runtime, _RUNTIME_FIELDS))


# The decisions' texts of the stages a fleet is resolving: every rank of a stage hands the
# store the rules' same read-only view (`rules.resolve.Resolution`), written once (service/lru.py).
_DECISIONS_TEXTS = LruCache(256)


def _decisions_json(plan: LoadPlan) -> str:
    """`plans.decisions_json` of a new plan: [[key, value, reason, rule, deployment_wide], ...].
    A resolved decision is revision 0, decided when its plan was created (no time of its own,
    or the plan's): what the column leaves out, so a decision that is not is refused rather
    than stored altered."""
    for d in plan.decisions.values():
        if d.revision != 0 or (d.decided_at is not None and d.decided_at != plan.created_at):
            raise ValueError(f"decision {d.key}: a new plan's decisions are revision 0 decided at its created_at "
                             f"({plan.created_at}), got revision {d.revision} decided at {d.decided_at}")
    if isinstance(plan.decisions, MappingProxyType):
        return _DECISIONS_TEXTS.of((plan.decisions,), lambda: _decisions_text(plan.decisions))
    return _decisions_text(plan.decisions)


def _decisions_text(decisions: Mapping[str, Decision]) -> str:
    return _dumps([[d.key, d.value, d.reason, d.rule, d.deployment_wide] for d in decisions.values()])


def _decision(row: Row) -> Decision:
    return Decision(key=row.key, value=json.loads(row.value_json), reason=row.reason, rule=row.rule,
                    deployment_wide=row.deployment_wide, revision=row.revision, decided_at=row.decided_at)


def _resolved_decisions(row: Row) -> list[Decision]:
    """The decisions a plan was resolved with, from its decisions_json (none for a plan written
    before revision 0002: those are rows of `decisions`)."""
    if row.decisions_json is None:
        return []
    return [Decision(key=key, value=value, reason=reason, rule=rule, deployment_wide=wide, revision=0,
                     decided_at=row.created_at)
            for key, value, reason, rule, wide in json.loads(row.decisions_json)]


def _known_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
    # Rows written by a newer registry may carry fields this one does not know.
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def _load_plan(row: Row, decision_rows: Sequence[Row], *, include_history: bool = False,
               replayed: bool = False) -> LoadPlan:
    every = sorted([*_resolved_decisions(row), *(_decision(r) for r in decision_rows)],
                   key=lambda d: (d.key, d.revision))
    latest = {d.key: d for d in every}   # sorted by revision: the last one wins
    request = ResolveRequest(
        request_id=row.request_id, deployment_id=row.deployment_id, role=row.role,
        parallel=Parallel(**{name: getattr(row, name) for name in _PARALLEL_FIELDS}),
        host=row.host,
        config=json.loads(row.config_json),
        quantization_config=None if row.quantization_config_json is None else json.loads(row.quantization_config_json),
        quantization=row.requested_quantization,
        runtime=Runtime(**_known_fields(Runtime, json.loads(row.runtime_json))),
    )
    history = tuple(sorted(every, key=lambda d: (d.decided_at, d.revision, d.key))) if include_history else ()
    return LoadPlan(plan_id=row.plan_id, ruleset_version=row.ruleset_version, request=request,
                    entry_class=row.entry_class, config_fingerprint=row.config_fingerprint,
                    quantization=row.quantization, decisions=latest, created_at=row.created_at,
                    replayed=replayed, history=history)


def _append_fingerprint(plan_id: str, decisions: Sequence[Decision]) -> str:
    # decided_at is left out: the registry stamps a retry with a new time.
    return fingerprint({"plan_id": plan_id,
                        "decisions": [[d.key, d.value, d.reason, d.rule, d.deployment_wide] for d in decisions]})


def _pin_refusal(new: NewPlan, mine_json: str, pin_plan_id: str, pin_json: str) -> FailedPrecondition | None:
    """The refusal of a plan whose deployment-wide inputs (`mine_json`) differ from its
    (deployment, role)'s pin (`pin_json`, set by plan `pin_plan_id`)."""
    if mine_json == pin_json:
        return None   # the same JSON: the same inputs (the common case, no parsing)
    pinned, mine = json.loads(pin_json), json.loads(mine_json)   # compared as the pin holds them
    differing = diff_deployment_inputs(pinned, mine)
    if not differing:
        return None
    req = new.plan.request
    details = "; ".join(f"{k}: pinned {pinned.get(k)!r}, this rank {mine.get(k)!r}" for k in differing)
    return FailedPrecondition(
        f"deployment {req.deployment_id!r} role {req.role!r} is pinned by its first rank (plan "
        f"{pin_plan_id}) to different deployment-wide inputs; every rank must agree on "
        f"{', '.join(differing)} ({details})", field=differing[0])


def _reused_id(new: NewPlan, plan_id: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"request_id {new.plan.request.request_id!r} was used for a different request (plan {plan_id}); "
        f"a retry must repeat the request exactly, a new request needs a new request_id", field="request_id")


def _chunks(xs: Sequence[Any], n: int = LOOKUP_CHUNK) -> Iterator[Sequence[Any]]:
    for i in range(0, len(xs), n):
        yield xs[i:i + n]


class SqlPlanStore:
    """`PlanStore` on SQLite or PostgreSQL; `engine` from `db.make_engine`, migrated to head."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._writer = writer(engine)
        insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        self._insert_pins = insert(PINS).on_conflict_do_nothing(index_elements=["deployment_id", "role"]) \
            .execution_options(preserve_rowcount=True)
        self._pin_cache: dict[tuple[str, str], Pin] = {}   # (deployment, role) -> its committed pin

    def _run(self, what: str, fn, *, write: bool):
        """`fn(connection, attempt)` in one transaction, committed; started over when it lost a race."""
        last: BaseException | None = None
        for attempt in range(MAX_ATTEMPTS):
            try:
                with _translate_errors(what), (self._writer if write else self.engine).begin() as conn:
                    return fn(conn, attempt)
            except _Retry as err:
                last = err.__cause__
        raise Unavailable(f"database contention while {what}: gave up after {MAX_ATTEMPTS} attempts "
                          f"({_short(last) if last else 'unknown'}); retry with the same request id")

    # --- saving plans ---------------------------------------------------------------

    def save_plan(self, new: NewPlan) -> LoadPlan:
        outcome = self.save_batch([new])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def save_batch(self, news: Sequence[NewPlan]) -> list[LoadPlan | Exception]:
        """`save_plan` of each of `news` in ONE transaction (see the module's docstring): one
        outcome per plan, in order. A plan the database refuses for its own sake (not a lost
        race, not the database being down) is that plan's outcome: the others are written
        again without it. Raises Unavailable (nothing written) when the database is down."""
        if not news:
            return []
        learned: dict[tuple[str, str], Pin] = {}
        try:
            outcomes = self._run("saving a plan", lambda conn, attempt: self._save(conn, news, attempt > 0, learned),
                                 write=True)
        except Unavailable:
            raise
        except Exception as err:  # noqa: BLE001 - one plan's fault must not fail the others
            if len(news) == 1:
                return [err]
            return [self._save_alone(new) for new in news]
        if len(self._pin_cache) + len(learned) > PIN_CACHE_SIZE:
            self._pin_cache.clear()
        self._pin_cache.update(learned)   # committed now
        return outcomes

    def _save_alone(self, new: NewPlan) -> LoadPlan | Exception:
        try:
            return self.save_batch([new])[0]
        except Exception as err:  # noqa: BLE001 - this plan's own answer
            return err

    def _save(self, conn: Connection, news: Sequence[NewPlan], retried: bool,
              learned: dict[tuple[str, str], Pin]) -> list[LoadPlan | Exception]:
        """One try of a batch in the open transaction of `conn`. The first try assumes no request
        id of the batch is stored (a client retry is rare): if one is, inserting its plan is a
        unique violation, the transaction starts over, and the retries look the ids up first
        (a round trip fewer for every batch but those). A plan refused meanwhile has its id
        looked up before anything is written: a reused id is refused as that. Likewise the first
        try reads no pin: a (deployment, role) this process saw pinned is checked against the
        pin it saw, another is pinned by the batch's first plan of it (ON CONFLICT DO NOTHING)
        and read back after (the plans are written by then: a plan that disagrees with a pin set
        first by another writer starts the transaction over). `learned`: the pins the
        transaction read or wrote, for the cache once it committed."""
        learned.clear()
        outcomes: list[LoadPlan | Exception | None] = [None] * len(news)
        stored = self._stored_requests(conn, sorted({n.plan.request.request_id for n in news})) if retried else {}
        groups = {_group(n) for n in news}
        cached = self._pin_cache   # shared by concurrent callers: read each key once (no `in` then [])
        pins = {g: pin for g in groups if (pin := cached.get(g)) is not None}
        if retried:
            pins.update(self._pins(conn, sorted(groups - pins.keys())))
            learned.update(pins)
        first_of: dict[str, int] = {}           # request id -> the batch's first plan of it
        replays: dict[int, str] = {}            # plan -> the stored plan id it replays
        setters: dict[tuple[str, str], NewPlan] = {}   # (deployment, role) -> the plan that pins it
        writes: list[NewPlan] = []
        texts: dict[int, str] = {}

        def inputs_json(new: NewPlan) -> str:
            """The JSON of `new`'s deployment inputs, once per inputs object of the batch (the
            rules hand every rank of a deployment the same one)."""
            key = id(new.deployment_inputs)
            if key not in texts:
                texts[key] = _dumps(dict(new.deployment_inputs))
            return texts[key]

        for i, new in enumerate(news):
            req = new.plan.request
            if req.request_id in first_of:      # a second plan of one request id: after the first
                continue
            first_of[req.request_id] = i
            row = stored.get(req.request_id)
            if row is not None:
                if row.request_fingerprint == new.request_fingerprint:
                    replays[i] = row.plan_id
                else:
                    outcomes[i] = _reused_id(new, row.plan_id)
                continue
            group = (req.deployment_id, req.role)
            pin = pins.get(group)
            if pin is None and group not in setters:
                setters[group] = new
            else:
                by = pin.plan_id if pin is not None else setters[group].plan.plan_id
                pinned = pin.inputs_json if pin is not None else inputs_json(setters[group])
                refusal = _pin_refusal(new, inputs_json(new), by, pinned)
                if refusal is not None:
                    outcomes[i] = refusal
                    continue
            writes.append(new)
            outcomes[i] = new.plan
        if not retried and len(writes) < len(first_of):
            # A refusal: the request id may be stored (a reused id is refused as that, first).
            return self._save(conn, news, True, learned)
        if writes:
            conn.execute(sa.insert(PLANS), [_plan_row(n) for n in sorted(writes, key=_request_id)])
        if setters:
            rows = [_pin_row(setters[g], inputs_json(setters[g])) for g in sorted(setters)]
            # Without RETURNING, an executemany of one short statement, whose rowcount (the rows
            # inserted, kept by `preserve_rowcount`) says whether every pin is ours; only when one
            # is not are they read back. (RETURNING makes it one long statement of every row, which
            # psycopg parses anew each time: 0.1 ms of CPU a pin.)
            inserted = conn.execute(self._insert_pins, rows).rowcount
            theirs = {} if inserted == len(rows) else {g: pin for g, pin in self._pins(conn, sorted(setters)).items()
                                                       if pin.plan_id != setters[g].plan.plan_id}
            learned.update((g, Pin(setters[g].plan.plan_id, inputs_json(setters[g]))) for g in setters
                           if g not in theirs)
            if theirs:
                # Pinned by another writer (before us, or since we looked); if every plan of ours
                # agrees with its pin, what we wrote stands, else start over (and refuse those then).
                learned.update(theirs)
                if any(_pin_refusal(n, inputs_json(n), theirs[_group(n)].plan_id, theirs[_group(n)].inputs_json)
                       is not None for n in writes if _group(n) in theirs):
                    raise _Retry()
        if replays:
            loaded = self._load_plans(conn, sorted(set(replays.values())), replayed=True)
            for i, plan_id in replays.items():
                outcomes[i] = loaded[plan_id]
        for i, new in enumerate(news):   # the second plans of a request id: as if saved after the first
            first = first_of[new.plan.request.request_id]
            if first != i:
                outcomes[i] = _again(new, news[first], outcomes[first])
        return outcomes

    @staticmethod
    def _stored_requests(conn: Connection, request_ids: list[str]) -> dict[str, Row]:
        c = PLANS.c
        found = {}
        for chunk in _chunks(request_ids):
            query = sa.select(c.request_id, c.plan_id, c.request_fingerprint).where(c.request_id.in_(chunk))
            found.update((r.request_id, r) for r in conn.execute(query))
        return found

    @staticmethod
    def _pins(conn: Connection, groups: list[tuple[str, str]]) -> dict[tuple[str, str], Pin]:
        c = PINS.c
        found = {}
        for chunk in _chunks(groups):
            query = sa.select(c.deployment_id, c.role, c.plan_id, c.inputs_json).where(
                sa.tuple_(c.deployment_id, c.role).in_(chunk))
            found.update(((r.deployment_id, r.role), Pin(r.plan_id, r.inputs_json)) for r in conn.execute(query))
        return found

    # --- reading plans ----------------------------------------------------------------

    @staticmethod
    def _decisions_of(conn: Connection, plan_ids: Sequence[str]) -> dict[str, list[Row]]:
        out: dict[str, list[Row]] = {pid: [] for pid in plan_ids}
        for chunk in _chunks(list(plan_ids)):
            for r in conn.execute(sa.select(DECISIONS).where(DECISIONS.c.plan_id.in_(chunk))):
                out[r.plan_id].append(r)
        return out

    def _load_plans(self, conn: Connection, plan_ids: list[str], *, include_history: bool = False,
                    replayed: bool = False) -> dict[str, LoadPlan]:
        rows = [r for chunk in _chunks(plan_ids) for r in conn.execute(sa.select(PLANS).where(
            PLANS.c.plan_id.in_(chunk)))]
        decisions = self._decisions_of(conn, [r.plan_id for r in rows])
        return {r.plan_id: _load_plan(r, decisions[r.plan_id], include_history=include_history, replayed=replayed)
                for r in rows}

    def _get(self, conn: Connection, plan_id: str, *, include_history: bool = False,
             replayed: bool = False) -> LoadPlan:
        plan = self._load_plans(conn, [plan_id], include_history=include_history, replayed=replayed).get(plan_id)
        if plan is None:
            raise NotFound("plan", plan_id, field="plan_id")
        return plan

    def get_plan(self, plan_id: str, include_history: bool = False) -> LoadPlan:
        return self._run("reading a plan", lambda conn, _: self._get(conn, plan_id, include_history=include_history),
                         write=False)

    def list_plans(self, flt: PlanFilter, page_size: int, page_token: str | None) -> tuple[list[LoadPlan], str]:
        after = decode_page_token(page_token) if page_token else None
        c = PLANS.c
        conds = [c[name] == getattr(flt, name) for name in ("deployment_id", "role", "entry_class", "host")
                 if getattr(flt, name) not in (None, "")]
        if flt.created_after is not None:
            conds.append(c.created_at >= _utc(flt.created_after, "created_after"))
        if flt.created_before is not None:
            conds.append(c.created_at < _utc(flt.created_before, "created_before"))
        if after is not None:
            t, pid = after
            conds.append(sa.or_(c.created_at < t, sa.and_(c.created_at == t, c.plan_id < pid)))
        query = sa.select(PLANS).where(*conds).order_by(c.created_at.desc(), c.plan_id.desc()).limit(page_size + 1)

        def run(conn: Connection, _attempt: int):
            rows = conn.execute(query).all()
            more = len(rows) > page_size
            rows = rows[:page_size]
            decisions = self._decisions_of(conn, [r.plan_id for r in rows])
            plans = [_load_plan(r, decisions[r.plan_id]) for r in rows]
            token = encode_page_token(rows[-1].created_at, rows[-1].plan_id) if more else ""
            return plans, token

        return self._run("listing plans", run, write=False)

    # --- appending decisions -------------------------------------------------------------

    def append_decisions(self, request_id: str, plan_id: str, decisions: Sequence[Decision]) -> LoadPlan:
        fp = _append_fingerprint(plan_id, decisions)
        return self._run("appending decisions",
                         lambda conn, _: self._append(conn, request_id, plan_id, list(decisions), fp), write=True)

    def _append(self, conn: Connection, request_id: str, plan_id: str, decisions: list[Decision],
                fp: str) -> LoadPlan:
        done = conn.execute(sa.select(APPENDS).where(APPENDS.c.request_id == request_id)).first()
        if done is not None:
            if done.plan_id != plan_id or done.request_fingerprint != fp:
                raise FailedPrecondition(
                    f"request_id {request_id!r} was used for a different request (append to plan "
                    f"{done.plan_id}); a retry must repeat the request exactly", field="request_id")
            return self._get(conn, plan_id, replayed=True)
        # Lock the plan row (PostgreSQL; SQLite already holds the write lock) so
        # concurrent appends to one plan take revisions one after the other.
        locked = conn.execute(sa.select(PLANS.c.plan_id, PLANS.c.decisions_json, PLANS.c.created_at)
                              .where(PLANS.c.plan_id == plan_id).with_for_update()).first()
        if locked is None:
            raise NotFound("plan", plan_id, field="plan_id")
        current = {d.key: d.revision for d in _resolved_decisions(locked)}
        current.update(conn.execute(
            sa.select(DECISIONS.c.key, sa.func.max(DECISIONS.c.revision))
            .where(DECISIONS.c.plan_id == plan_id).group_by(DECISIONS.c.key)).all())
        values = []
        for d in decisions:
            if d.decided_at is None:
                raise ValueError(f"decision {d.key} has no decided_at")
            revision = current.get(d.key, -1) + 1   # a key new to the plan starts at 0 like resolved ones
            current[d.key] = revision
            values.append(dict(plan_id=plan_id, key=d.key, revision=revision, value_json=_dumps(d.value),
                               reason=d.reason, rule=d.rule, deployment_wide=d.deployment_wide,
                               decided_at=d.decided_at))
        conn.execute(sa.insert(DECISIONS), values)
        # A concurrent retry of this request id that got past the check above fails
        # here on the primary key, starts over and replays.
        conn.execute(sa.insert(APPENDS).values(request_id=request_id, plan_id=plan_id, request_fingerprint=fp,
                                               created_at=decisions[-1].decided_at))
        return self._get(conn, plan_id)

    def ready(self) -> bool:
        """The database answers and is migrated to head. Never raises."""
        return is_at_head(self.engine)


def _request_id(new: NewPlan) -> str:
    return new.plan.request.request_id


def _group(new: NewPlan) -> tuple[str, str]:
    return new.plan.request.deployment_id, new.plan.request.role


def _pin_row(new: NewPlan, inputs_json: str) -> dict[str, Any]:
    plan = new.plan
    return dict(deployment_id=plan.request.deployment_id, role=plan.request.role,
                inputs_json=inputs_json, ruleset_version=plan.ruleset_version,
                plan_id=plan.plan_id, created_at=plan.created_at)


def _again(new: NewPlan, first: NewPlan, outcome: LoadPlan | Exception) -> LoadPlan | Exception:
    """The outcome of `new`, a plan with the request id of `first` (earlier in the batch, with
    `outcome`): what saving it after `first` answers."""
    if new.request_fingerprint != first.request_fingerprint:
        return _reused_id(new, first.plan.plan_id)
    if isinstance(outcome, Exception):
        return outcome
    return dataclasses.replace(outcome.dated(), replayed=True)   # as a replay reads it back
