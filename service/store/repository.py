"""`SqlPlanStore`: the `PlanStore` protocol of service/registry.py on SQLAlchemy.

Every call is one transaction (`UnitOfWork`: rolled back on exit unless
committed), so a failed call leaves nothing behind (DESIGN 6, 7).

Concurrency (many ranks of one deployment at once, several registry replicas):
- SQLite: write transactions BEGIN IMMEDIATE (service/store/db.py), so writers
  run one at a time and every check sees every committed row.
- PostgreSQL (READ COMMITTED): the unique keys arbitrate. `save_plan` inserts
  the plan (unique request_id) and then the pin, both with ON CONFLICT DO
  NOTHING, which waits for a concurrent inserter of the same key and then yields
  to the winner's row: a racing duplicate request id becomes a replay, a later
  rank reads the first rank's pin. Should a race still surface as a unique
  violation (or a deadlock), the whole call starts over.
  Inserting the plan before the pin keeps the lock order one-way (a transaction
  waiting on a pin holds no key that another one waits on): no deadlock.
Connection errors become `errors.Unavailable` (the client retries with the same
request id, which is safe because of the above).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import datetime as dt
import json
from typing import Any, Iterable, Iterator, Sequence

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine, Row

from ...plan import Decision, LoadPlan, Parallel, ResolveRequest, Runtime
from ..errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from ..registry import NewPlan, PlanFilter
from ..rules.resolve import diff_deployment_inputs, fingerprint
from .db import is_at_head, writer
from .models import DecisionAppendRow, DecisionRow, DeploymentPinRow, PlanRow

# Core tables: the hot path writes a plan in a handful of statements, without the
# ORM unit of work (a resolve is a few inserts; identity maps buy nothing here).
PLANS: sa.Table = PlanRow.__table__
DECISIONS: sa.Table = DecisionRow.__table__
PINS: sa.Table = DeploymentPinRow.__table__
APPENDS: sa.Table = DecisionAppendRow.__table__

# A call that lost a race (concurrent duplicate request id, PostgreSQL deadlock or
# serialization failure) starts over this many times before giving up as UNAVAILABLE.
MAX_ATTEMPTS = 5

# SQLSTATEs worth retrying in place: serialization_failure, deadlock_detected.
_RETRY_SQLSTATES = {"40001", "40P01"}


class _Retry(Exception):
    """Internal: the transaction lost a race; run it again."""


class UnitOfWork:
    """One transaction on one connection: rolled back on exit unless `commit()` ran."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.committed = False

    def __enter__(self) -> "UnitOfWork":
        self.conn = self.engine.connect()
        try:
            self.tx = self.conn.begin()
        except BaseException:
            self.conn.close()
            raise
        return self

    def commit(self) -> None:
        self.tx.commit()
        self.committed = True

    def __exit__(self, *exc) -> None:
        try:
            if not self.committed and self.tx.is_active:
                self.tx.rollback()
        finally:
            self.conn.close()


def _sqlstate(err: BaseException) -> str | None:
    orig = getattr(err, "orig", None)
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


def _is_unique_violation(err: sa_exc.IntegrityError) -> bool:
    # A concurrent writer stored the same request id (or the same next revision) first.
    return _sqlstate(err) == "23505" or "UNIQUE constraint failed" in str(err.orig)


def _is_missing_table(err: sa_exc.DBAPIError) -> bool:
    # An unmigrated database is not ready, like an unreachable one (health says NOT_SERVING).
    return _sqlstate(err) == "42P01" or "no such table" in str(err.orig)


def _is_unavailable(err: BaseException) -> bool:
    if isinstance(err, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError)):
        return True
    if isinstance(err, sa_exc.DBAPIError) and err.connection_invalidated:
        return True
    try:
        import psycopg
    except ImportError:   # the SQLite-only install
        return False
    return isinstance(err, (psycopg.OperationalError, psycopg.InterfaceError))


@contextlib.contextmanager
def _translate_errors(what: str) -> Iterator[None]:
    """Database-unreachable errors -> Unavailable; lost races -> _Retry; the rest unchanged."""
    try:
        yield
    except sa_exc.IntegrityError as err:
        if _is_unique_violation(err):
            raise _Retry() from err
        raise
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
    except Exception as err:
        if _is_unavailable(err):
            raise Unavailable(f"database unavailable while {what}: {_short(err)}; retry with the same request id") \
                from err
        raise


def _short(err: BaseException) -> str:
    orig = getattr(err, "orig", None) or err
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0][:300]


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _utc(value: dt.datetime, field: str) -> dt.datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgument(field, f"{value.isoformat()} has no time zone; pass an aware (UTC) time")
    return value.astimezone(dt.timezone.utc)


# --- page tokens --------------------------------------------------------------------
# Opaque to clients: base64url of the last row's keyset position.

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


# --- rows <-> domain ------------------------------------------------------------------

def _plan_values(new: NewPlan) -> dict[str, Any]:
    plan, req = new.plan, new.plan.request
    p = req.parallel
    return dict(
        plan_id=plan.plan_id, request_id=req.request_id, request_fingerprint=new.request_fingerprint,
        deployment_id=req.deployment_id, role=req.role, host=req.host,
        tp_size=p.tp_size, tp_rank=p.tp_rank, ep_size=p.ep_size, ep_rank=p.ep_rank,
        pp_size=p.pp_size, pp_rank=p.pp_rank, dp_size=p.dp_size, dp_rank=p.dp_rank,
        entry_class=plan.entry_class, config_fingerprint=plan.config_fingerprint,
        config_json=_dumps(dict(req.config)),
        quantization=plan.quantization, requested_quantization=req.quantization,
        quantization_config_json=None if req.quantization_config is None else _dumps(dict(req.quantization_config)),
        runtime_json=_dumps(dataclasses.asdict(req.runtime)),
        ruleset_version=plan.ruleset_version, created_at=plan.created_at,
    )


def _decision_values(plan_id: str, d: Decision, revision: int) -> dict[str, Any]:
    if d.decided_at is None:
        raise ValueError(f"decision {d.key} has no decided_at")
    return dict(plan_id=plan_id, key=d.key, revision=revision, value_json=_dumps(d.value),
                reason=d.reason, rule=d.rule, deployment_wide=d.deployment_wide, decided_at=d.decided_at)


def _known_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
    # Rows written by a newer registry may carry fields this one does not know.
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def _decision(row: Row) -> Decision:
    return Decision(key=row.key, value=json.loads(row.value_json), reason=row.reason, rule=row.rule,
                    deployment_wide=row.deployment_wide, revision=row.revision, decided_at=row.decided_at)


def _load_plan(row: Row, decision_rows: Iterable[Row], *, include_history: bool,
               replayed: bool = False) -> LoadPlan:
    every = sorted((_decision(r) for r in decision_rows), key=lambda d: (d.key, d.revision))
    latest: dict[str, Decision] = {}
    for d in every:
        latest[d.key] = d   # sorted by revision: the last one wins
    request = ResolveRequest(
        request_id=row.request_id, deployment_id=row.deployment_id, role=row.role,
        parallel=Parallel(tp_size=row.tp_size, tp_rank=row.tp_rank, ep_size=row.ep_size, ep_rank=row.ep_rank,
                          pp_size=row.pp_size, pp_rank=row.pp_rank, dp_size=row.dp_size, dp_rank=row.dp_rank),
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


class SqlPlanStore:
    """`PlanStore` on SQLite or PostgreSQL; `engine` from `db.make_engine`, migrated to head."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._writer = writer(engine)

    # --- plumbing ---------------------------------------------------------------

    def unit_of_work(self, *, write: bool = False) -> UnitOfWork:
        return UnitOfWork(self._writer if write else self.engine)

    def _run(self, what: str, fn, *, write: bool):
        """`fn(connection)` in one transaction; started over when it lost a race."""
        last: BaseException | None = None
        for _ in range(MAX_ATTEMPTS):
            try:
                with _translate_errors(what), self.unit_of_work(write=write) as uow:
                    result = fn(uow.conn)
                    uow.commit()
                    return result
            except _Retry as err:
                last = err.__cause__
        raise Unavailable(f"database contention while {what}: gave up after {MAX_ATTEMPTS} attempts "
                          f"({_short(last) if last else 'unknown'}); retry with the same request id")

    @staticmethod
    def _insert(conn: Connection, table: sa.Table):
        # INSERT ... ON CONFLICT DO NOTHING RETURNING, on both databases (SQLite >= 3.35).
        if conn.dialect.name == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        return insert(table)

    @staticmethod
    def _decisions_of(conn: Connection, plan_ids: Sequence[str]) -> dict[str, list[Row]]:
        out: dict[str, list[Row]] = {pid: [] for pid in plan_ids}
        if plan_ids:
            for r in conn.execute(sa.select(DECISIONS).where(DECISIONS.c.plan_id.in_(plan_ids))):
                out[r.plan_id].append(r)
        return out

    def _get(self, conn: Connection, plan_id: str, *, include_history: bool, replayed: bool = False) -> LoadPlan:
        row = conn.execute(sa.select(PLANS).where(PLANS.c.plan_id == plan_id)).first()
        if row is None:
            raise NotFound("plan", plan_id, field="plan_id")
        return _load_plan(row, self._decisions_of(conn, [plan_id])[plan_id],
                          include_history=include_history, replayed=replayed)

    # --- PlanStore ----------------------------------------------------------------

    def save_plan(self, new: NewPlan) -> LoadPlan:
        return self._run("saving a plan", lambda conn: self._save_plan(conn, new), write=True)

    def _save_plan(self, conn: Connection, new: NewPlan) -> LoadPlan:
        plan, req = new.plan, new.plan.request
        # The plan row first (see the module docstring: lock order). ON CONFLICT on the
        # request id waits for a concurrent writer of the same id and then does nothing.
        inserted = conn.execute(
            self._insert(conn, PLANS).values(**_plan_values(new))
            .on_conflict_do_nothing(index_elements=["request_id"]).returning(PLANS.c.plan_id)).first()
        if inserted is None:
            return self._replay(conn, new)
        conn.execute(sa.insert(DECISIONS), [_decision_values(plan.plan_id, d, d.revision)
                                            for d in plan.decisions.values()])
        self._pin(conn, new)
        return plan

    def _replay(self, conn: Connection, new: NewPlan) -> LoadPlan:
        req = new.plan.request
        stored = conn.execute(sa.select(PLANS.c.plan_id, PLANS.c.request_fingerprint)
                              .where(PLANS.c.request_id == req.request_id)).one()
        if stored.request_fingerprint != new.request_fingerprint:
            raise FailedPrecondition(
                f"request_id {req.request_id!r} was used for a different request (plan {stored.plan_id}); "
                f"a retry must repeat the request exactly, a new request needs a new request_id",
                field="request_id")
        return self._get(conn, stored.plan_id, include_history=False, replayed=True)

    def _pin(self, conn: Connection, new: NewPlan) -> None:
        plan, req = new.plan, new.plan.request
        mine = conn.execute(
            self._insert(conn, PINS).values(
                deployment_id=req.deployment_id, role=req.role, inputs_json=_dumps(new.deployment_inputs),
                ruleset_version=plan.ruleset_version, plan_id=plan.plan_id, created_at=plan.created_at)
            .on_conflict_do_nothing(index_elements=["deployment_id", "role"]).returning(PINS.c.plan_id)).first()
        if mine is not None:
            return   # this rank is the first one: it set the pin
        # A separate statement: under READ COMMITTED it sees the pin that the
        # ON CONFLICT above waited for (one statement's snapshot would not).
        pin = conn.execute(sa.select(PINS.c.plan_id, PINS.c.inputs_json).where(
            PINS.c.deployment_id == req.deployment_id, PINS.c.role == req.role)).one()
        pinned = json.loads(pin.inputs_json)
        differing = diff_deployment_inputs(pinned, new.deployment_inputs)
        if differing:
            details = "; ".join(f"{k}: pinned {pinned.get(k)!r}, this rank {new.deployment_inputs.get(k)!r}"
                                for k in differing)
            raise FailedPrecondition(
                f"deployment {req.deployment_id!r} role {req.role!r} is pinned by its first rank (plan "
                f"{pin.plan_id}) to different deployment-wide inputs; every rank must agree on "
                f"{', '.join(differing)} ({details})", field=differing[0])

    def get_plan(self, plan_id: str, include_history: bool = False) -> LoadPlan:
        return self._run("reading a plan",
                         lambda conn: self._get(conn, plan_id, include_history=include_history), write=False)

    def list_plans(self, flt: PlanFilter, page_size: int, page_token: str | None) -> tuple[list[LoadPlan], str]:
        after = decode_page_token(page_token) if page_token else None
        c = PLANS.c
        conds = []
        for name in ("deployment_id", "role", "entry_class", "host"):
            value = getattr(flt, name)
            if value is not None and value != "":
                conds.append(c[name] == value)
        if flt.created_after is not None:
            conds.append(c.created_at >= _utc(flt.created_after, "created_after"))
        if flt.created_before is not None:
            conds.append(c.created_at < _utc(flt.created_before, "created_before"))
        if after is not None:
            t, pid = after
            conds.append(sa.or_(c.created_at < t, sa.and_(c.created_at == t, c.plan_id < pid)))
        query = sa.select(PLANS).where(*conds).order_by(c.created_at.desc(), c.plan_id.desc()).limit(page_size + 1)

        def run(conn: Connection):
            rows = conn.execute(query).all()
            more = len(rows) > page_size
            rows = rows[:page_size]
            decisions = self._decisions_of(conn, [r.plan_id for r in rows])
            plans = [_load_plan(r, decisions[r.plan_id], include_history=False) for r in rows]
            token = encode_page_token(rows[-1].created_at, rows[-1].plan_id) if more else ""
            return plans, token

        return self._run("listing plans", run, write=False)

    def append_decisions(self, request_id: str, plan_id: str, decisions: Sequence[Decision]) -> LoadPlan:
        fp = _append_fingerprint(plan_id, decisions)
        return self._run("appending decisions",
                         lambda conn: self._append(conn, request_id, plan_id, list(decisions), fp), write=True)

    def _append(self, conn: Connection, request_id: str, plan_id: str, decisions: list[Decision],
                fp: str) -> LoadPlan:
        done = conn.execute(sa.select(APPENDS).where(APPENDS.c.request_id == request_id)).first()
        if done is not None:
            if done.plan_id != plan_id or done.request_fingerprint != fp:
                raise FailedPrecondition(
                    f"request_id {request_id!r} was used for a different request (append to plan "
                    f"{done.plan_id}); a retry must repeat the request exactly", field="request_id")
            return self._get(conn, plan_id, include_history=False, replayed=True)

        # Lock the plan row (PostgreSQL; SQLite already holds the write lock) so
        # concurrent appends to one plan take revisions one after the other.
        locked = conn.execute(sa.select(PLANS.c.plan_id).where(PLANS.c.plan_id == plan_id).with_for_update()).first()
        if locked is None:
            raise NotFound("plan", plan_id, field="plan_id")
        current = dict(conn.execute(
            sa.select(DECISIONS.c.key, sa.func.max(DECISIONS.c.revision))
            .where(DECISIONS.c.plan_id == plan_id).group_by(DECISIONS.c.key)).all())
        values = []
        for d in decisions:
            revision = current.get(d.key, -1) + 1   # a key new to the plan starts at 0 like resolved ones
            current[d.key] = revision
            values.append(_decision_values(plan_id, d, revision))
        conn.execute(sa.insert(DECISIONS), values)
        # A concurrent retry of this request id that got past the check above fails
        # here on the primary key, starts over and replays.
        conn.execute(sa.insert(APPENDS).values(
            request_id=request_id, plan_id=plan_id, request_fingerprint=fp,
            created_at=decisions[-1].decided_at or dt.datetime.now(dt.timezone.utc)))
        return self._get(conn, plan_id, include_history=False)

    def ready(self) -> bool:
        """The database answers and is migrated to head. Never raises."""
        return is_at_head(self.engine)
