"""`SqlPlanStore`: the `PlanStore` protocol of service/registry.py on SQLAlchemy.

Every call is one transaction (`UnitOfWork`: rolled back on exit unless
committed), so a failed call leaves nothing behind (DESIGN 6, 7).

`save_plan` is group-committed (service/store/group_commit.py): the plans saved
at the same time are written in ONE transaction, one COMMIT (one WAL flush)
for all, and each caller returns after that COMMIT with its own answer, the
same as saving the plans one after the other in batch order:
- every refusal (a reused request id, inputs that differ from the pin) is
  decided in Python before anything is written, so it fails that plan only;
- pins are immutable once written, so the store remembers the ones it has seen
  committed (`_PinCache`) and checks a rank of a known deployment without a
  look-up;
- a second call with a request id already in the batch waits for the next
  batch, where it replays (or is refused) against the committed first one;
- if the database refuses the batch for one plan's sake (not a lost race), the
  plans are written one by one, so each caller gets its own answer.

Concurrency (many ranks of one deployment at once, several registry replicas):
- SQLite: write transactions BEGIN IMMEDIATE (service/store/db.py), so writers
  run one at a time and every look-up sees every committed row.
- PostgreSQL (READ COMMITTED): the unique keys arbitrate, between replicas and
  between the (up to `PG_BATCHES_IN_FLIGHT`) batches of one process alike. A
  batch first goes the optimistic way (`_pg_fast`): ONE autocommitted statement,
  one round trip with its commit, inserting the plans (a stored request id is a
  unique violation that fails it whole) and the new pins (ON CONFLICT DO
  NOTHING, which waits for a concurrent inserter of the same pin and then
  yields to the winner's row), and only the plans whose pin is known to agree
  or was set by the statement itself. What it leaves (a pin set elsewhere,
  inputs whose JSON differs from the pin's) or refuses as a whole (a stored
  request id, a deadlock) goes the careful way: in a transaction, request ids
  and pins looked up first, then BEGIN + plans + pins in one round trip (psycopg
  pipeline mode, `_pg_insert`) and COMMIT. Rows are inserted in key order.
  Each statement carries its whole batch of rows as one JSON parameter
  (`_pg_from_json`).
A plan is ONE row: its resolved decisions are a JSON column (`decisions_json`,
migration 0002); `decisions` rows hold the revisions AppendDecisions adds.
Connection errors become `errors.Unavailable` for every plan of the batch (the
client retries with the same request id, which is safe because of the above).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import datetime as dt
import json
import operator
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine, Row

from ...plan import Decision, LoadPlan, Parallel, ResolveRequest, Runtime
from ..errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from ..memo import ByIdentity, Memo, is_shared_view
from ..registry import NewPlan, PlanFilter
from ..rules.resolve import diff_deployment_inputs, fingerprint
from .db import WATCHDOG, arm_watchdog, borrow_autocommit, is_at_head, operation_timeout, writer
from .group_commit import DEFER, GroupCommit, GroupCommitTimeout
from .models import DecisionAppendRow, DecisionRow, DeploymentPinRow, PlanRow, UTCDateTime

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

# Most plans one group commit writes in one transaction.
MAX_BATCH = 256
# PostgreSQL: group commits written at the same time, so that one batch runs its statements
# while the one before waits for its WAL flush.
PG_BATCHES_IN_FLIGHT = 2
# Database calls' worth of time (db.operation_timeout) a plan waits for its group commit.
WAIT_TIMEOUT_CALLS = 2
# Pins this process remembers (they never change once written): a rank of a known
# deployment is checked without a look-up. Oldest forgotten first.
PIN_CACHE_SIZE = 65536

_PLAN_COLUMNS = tuple(c.name for c in PLANS.columns)
_PIN_COLUMNS = tuple(c.name for c in PINS.columns)
# `_Item` builds its rows as plain tuples in these orders (a dict per row costs more than
# the database spends on it): a model change must show up here, not as shifted values.
_ROW_LAYOUTS = {
    "plans": ("plan_id", "request_id", "request_fingerprint", "deployment_id", "role", "host",
              "tp_size", "tp_rank", "ep_size", "ep_rank", "pp_size", "pp_rank", "dp_size", "dp_rank",
              "entry_class", "config_fingerprint", "config_json", "quantization", "requested_quantization",
              "quantization_config_json", "runtime_json", "ruleset_version", "created_at", "decisions_json"),
    "deployment_pins": ("deployment_id", "role", "inputs_json", "ruleset_version", "plan_id", "created_at"),
}
for _table, _columns in (("plans", _PLAN_COLUMNS), ("deployment_pins", _PIN_COLUMNS)):
    if _columns != _ROW_LAYOUTS[_table]:
        raise ImportError(f"models.py changed the columns of {_table} to {_columns}; update _Item and _ROW_LAYOUTS "
                          f"in {__name__}")
# A JSON row of `_pg_from_json` holds a row's values in its layout's order, except for the long
# texts that repeat from plan to plan (a config, the decisions the rules share between ranks, a
# deployment's inputs): those come last, as their positions in the statement's list of texts
# (`_BatchTexts`), where each is written once, its JSON literal encoded once (`_literal`).
_LONG_TEXTS = {"plans": ("config_json", "quantization_config_json", "runtime_json", "decisions_json"),
               "deployment_pins": ("inputs_json",)}
_JSON_ORDER = {layout: tuple(c for c in cols if c not in _LONG_TEXTS[layout]) + _LONG_TEXTS[layout]
               for layout, cols in _ROW_LAYOUTS.items()}


def _pg_from_json(table: sa.Table, where: str = "", source: str = "jsonb_array_elements(%s::jsonb) AS r") -> str:
    """`INSERT INTO t (cols) SELECT ... FROM jsonb_array_elements(%s::jsonb) AS r`: a whole batch of
    rows in ONE parameter, a JSON array of row arrays (in the table's column order). jsonb, not
    json: the document is parsed once, where json re-parses a row's text for every `->>` (6x the
    database's time for a batch of plans, measured). Text values
    are assigned to their columns as they are, so an over-long value is refused, not truncated
    (an explicit cast to varchar(n) would truncate); the others are cast to their column's type.
    One JSON text of arrays is what the client builds fastest (no dict per row, one C encoder
    call per batch): a batch holds thousands of values, built on the server's one event-loop thread."""
    cols = ", ".join(c.name for c in table.columns)
    order = _JSON_ORDER[table.name]
    long = _LONG_TEXTS[table.name]
    fields = ", ".join(_pg_text_at(order.index(c.name)) if c.name in long else _pg_field(order.index(c.name), c)
                       for c in table.columns)
    return f"INSERT INTO {table.name} ({cols}) SELECT {fields} FROM {source}{where}"


# The statements' first parameter: the long texts of their JSON rows, each once (`_BatchTexts`),
# parsed once into this CTE; a row holds a text's position in it.
_PG_TEXTS = "texts AS MATERIALIZED (SELECT %s::jsonb AS j)"


def _pg_text_at(i: int) -> str:
    """The long text whose position in `texts` is field `i` of a JSON row `r` (NULL: none). The
    scalar subquery is uncorrelated: PostgreSQL runs it once per statement."""
    return f"((SELECT j FROM texts) ->> (r->>{i})::int)"


def _pg_cast(column: sa.Column) -> str | None:
    """The type a text value is cast to for `column` (None: text, assigned as it is)."""
    if isinstance(column.type, UTCDateTime):
        return "timestamptz"
    if isinstance(column.type, sa.Boolean):
        return "boolean"
    if isinstance(column.type, sa.Integer):
        return "integer"
    if isinstance(column.type, (sa.String, sa.Text)):
        return None
    raise ImportError(f"{column.table.name}.{column.name}: no conversion from text for {column.type!r}; "
                      f"add one to _pg_cast in {__name__}")


def _pg_field(i: int, column: sa.Column) -> str:
    """Field `i` of a JSON row `r`, as `column`'s type."""
    cast = _pg_cast(column)
    return f"(r->>{i})::{cast}" if cast else f"r->>{i}"


def _pg_param(column: sa.Column) -> str:
    """A parameter placeholder cast to `column`'s type (a SELECT list does not infer it)."""
    return f"%s::{_pg_cast(column) or 'text'}"


# PostgreSQL, the careful path: one statement for the plans (their decisions are a column) and
# one for the pins, so a batch is BEGIN, two statements, COMMIT.
_PG_INSERT_PLANS = f"WITH {_PG_TEXTS} {_pg_from_json(PLANS)}"
_PG_INSERT_PINS = (f"WITH {_PG_TEXTS} {_pg_from_json(PINS)} ON CONFLICT (deployment_id, role) DO NOTHING "
                   f"RETURNING deployment_id, role")


def _group_of(layout: str, alias: str) -> str:
    """`alias->>i, alias->>j`: the (deployment_id, role) of a JSON row of `layout`."""
    cols = _JSON_ORDER[layout]
    return f"{alias}->>{cols.index('deployment_id')}, {alias}->>{cols.index('role')}"


# PostgreSQL, the optimistic path: a whole batch in ONE autocommitted statement (one round
# trip, its commit included). Parameters: the pins to set (JSON rows), the plans, the pins again.
# A pin somebody already set is not overwritten (DO NOTHING, after waiting for a concurrent
# inserter), and the plans of its (deployment, role) are then left out: only the plans whose
# pin is known (checked in Python) or set by this very statement are inserted. The statement
# returns the ids of the plans it inserted; the others go the careful way. A stored request id
# fails the whole statement (unique violation): nothing written, the batch goes the careful way.
# The pins' foreign keys to their plans are checked at the end of the statement. Parameters: the
# long texts of both (`_BatchTexts`), the pins to set (JSON rows), the plans.
_PLAN_GROUP = _group_of("plans", "r")
# The pins' JSON (the first parameter) is parsed once (`pins_in`) for the two places that read it: 5 us of
# PostgreSQL's CPU a plan less than parsing it twice, measured in batches of 16 new deployments (of ~70).
_PG_SAVE = (
    f"WITH {_PG_TEXTS}, pins_in AS MATERIALIZED (SELECT r FROM jsonb_array_elements(%s::jsonb) AS r), "
    f"new_pins AS ({_pg_from_json(PINS, source='pins_in')} ON CONFLICT (deployment_id, role) DO NOTHING "
    f"RETURNING deployment_id, role), "
    f"new_plans AS ("
    + _pg_from_json(PLANS, where=(
        f" WHERE ({_PLAN_GROUP}) NOT IN (SELECT {_group_of('deployment_pins', 'p.r')} FROM pins_in AS p) "
        f"OR ({_PLAN_GROUP}) IN (SELECT deployment_id, role FROM new_pins)"))
    + " RETURNING plan_id) SELECT plan_id FROM new_plans")
# The same for a batch of ONE plan (a lone caller, the latency that counts): its values as plain
# parameters, so PostgreSQL parses no JSON and extracts no fields (0.05 ms less, measured). The
# plan's SELECT list is typed (a SELECT, unlike VALUES, does not infer parameter types from the
# columns); text parameters are assigned to their varchar columns, so an over-long value is
# refused, not truncated, as on the JSON way.
_PG_INSERT_ONE_PLAN = (f"INSERT INTO plans ({', '.join(c.name for c in PLANS.columns)}) "
                       f"VALUES ({', '.join(['%s'] * len(PLANS.columns))})")
_PG_SAVE_ONE = (
    f"WITH new_pins AS (INSERT INTO deployment_pins ({', '.join(c.name for c in PINS.columns)}) "
    f"VALUES ({', '.join(['%s'] * len(PINS.columns))}) ON CONFLICT (deployment_id, role) DO NOTHING RETURNING 1) "
    f"INSERT INTO plans ({', '.join(c.name for c in PLANS.columns)}) "
    f"SELECT {', '.join(_pg_param(c) for c in PLANS.columns)} WHERE EXISTS (SELECT 1 FROM new_pins) "
    f"RETURNING plan_id")
_PG_SELECT_REQUESTS = "SELECT request_id, plan_id, request_fingerprint FROM plans WHERE request_id = ANY(%b::text[])"
_PG_SELECT_PINS = (
    "SELECT p.deployment_id, p.role, p.plan_id, p.inputs_json FROM deployment_pins AS p "
    "JOIN unnest(%b::text[], %b::text[]) AS k(deployment_id, role) "
    "ON p.deployment_id = k.deployment_id AND p.role = k.role")
# SQLite: executemany of one-row INSERTs (in-process: no round trips to save); look-ups by IN lists.
_SQLITE_INSERT = {t.name: f"INSERT INTO {t.name} ({', '.join(c.name for c in t.columns)}) "
                          f"VALUES ({', '.join('?' * len(t.columns))})" for t in (PLANS, PINS)}
_SQLITE_SELECT_REQUESTS = "SELECT request_id, plan_id, request_fingerprint FROM plans WHERE request_id IN ({})"
_SQLITE_SELECT_PINS = ("SELECT deployment_id, role, plan_id, inputs_json FROM deployment_pins "
                       "WHERE (deployment_id, role) IN (VALUES {})")
_LOOKUP_CHUNK = 400   # keys per look-up statement (SQLite's variable limit is far above 2 * 400)


class _Retry(Exception):
    """Internal: the transaction lost a race; run it again."""


class FastStatement(NamedTuple):
    """The optimistic statement of a batch (`SqlPlanStore.fast_statement`)."""

    writes: list[int]          # the items it writes
    left: list[int]            # the items for the careful way, whatever it does
    pins: list["_Item"]        # the items whose pin it sets
    sql: str | None            # None: nothing to write
    params: tuple

    @property
    def returns_plan_ids(self) -> bool:
        return bool(self.pins)   # `_PG_SAVE` returns the plans it wrote; a plain insert writes all


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
    """The SQLSTATE of a driver error, raw (psycopg) or wrapped by SQLAlchemy (`.orig`)."""
    orig = getattr(err, "orig", None) or err
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
        # Raw psycopg errors (`PgAsyncWriter`, a pipeline's sync): the same translation.
        state = _sqlstate(err)
        if state == "23505" or state in _RETRY_SQLSTATES:
            raise _Retry() from err
        if state == "42P01":
            raise Unavailable(f"database not migrated while {what}: {_short(err)}; run `loadplan migrate --db URL`") \
                from err
        if _is_unavailable(err):
            raise Unavailable(f"database unavailable while {what}: {_short(err)}; retry with the same request id") \
                from err
        raise


def _short(err: BaseException) -> str:
    orig = getattr(err, "orig", None) or err
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0][:300]


def _json_encoder(default: Callable[[Any], Any] | None = None) -> Callable[[Any], str]:
    """`json.JSONEncoder(ensure_ascii=False, default=default).encode`, without building json's C
    encoder again for every call, as `encode` does (a third of the time of a row's few values);
    `encode` itself where json has no C encoder."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return json.JSONEncoder(ensure_ascii=False, default=default).encode
    encode = make(None, default or _unserializable, json.encoder.encode_basestring, None, ": ", ", ", False, False,
                  True)
    return lambda value: "".join(encode(value, 0))


def _unserializable(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# One encoder for every row: `json.dumps` with a keyword argument builds a new one per call.
_dumps = _json_encoder()


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


def _resolved_decisions(row: Row) -> list[Decision]:
    """The decisions a plan was resolved with, from its decisions_json (none for a plan written
    before revision 0002: those are rows of `decisions`)."""
    if row.decisions_json is None:
        return []
    return [Decision(key=key, value=value, reason=reason, rule=rule, deployment_wide=wide, revision=0,
                     decided_at=row.created_at)
            for key, value, reason, rule, wide in json.loads(row.decisions_json)]


def _load_plan(row: Row, decision_rows: Iterable[Row], *, include_history: bool,
               replayed: bool = False) -> LoadPlan:
    every = sorted([*_resolved_decisions(row), *(_decision(r) for r in decision_rows)],
                   key=lambda d: (d.key, d.revision))
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


def _chunks(xs: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(xs), n):
        yield xs[i:i + n]


def _json_rows(layout: str, rows: Iterable[tuple], texts: "_BatchTexts") -> str:
    """Rows (tuples in `_ROW_LAYOUTS[layout]` order) as the JSON array of row arrays that
    `_pg_from_json` reads (values in `_JSON_ORDER[layout]`); times in ISO 8601; each long text as
    its position in `texts`. Per row, one encoder call for its short values and one look-up for
    its long texts' positions."""
    return f"[{','.join([_json_row(layout, row, texts) for row in rows])}]"


def _json_row(layout: str, row: tuple, texts: "_BatchTexts") -> str:
    short_of, long_of = _JSON_GETTERS[layout]
    return f"{_dumps_short(short_of(row))[:-1]},{texts.positions(long_of(row))}]"


class _PlanRowTemplate:
    """The JSON row (`_json_rows`) of every plan made like `like` (`NewPlan.like`): theirs differ
    from its row only in the values before `middle` (plan id, request id, fingerprint, deployment
    id) and after it (created_at), so the rest is encoded once (`_Item.plan_json`)."""

    __slots__ = ("middle", "long")

    def __init__(self, like: NewPlan):
        short_of, long_of = _JSON_GETTERS["plans"]
        row = _Item(like).plan_row()
        self.middle = _dumps_short(short_of(row)[len(_OWN_VALUES):-1])[1:-1]
        self.long = long_of(row)


_OWN_VALUES = ("plan_id", "request_id", "request_fingerprint", "deployment_id")
assert _JSON_ORDER["plans"][:len(_OWN_VALUES)] == _OWN_VALUES, "_PlanRowTemplate: a plan's own values first"
assert _JSON_ORDER["plans"][-len(_LONG_TEXTS["plans"]) - 1] == "created_at", "_PlanRowTemplate: then created_at"
_plan_row_template = ByIdentity(_PlanRowTemplate)


class _BatchTexts:
    """The long texts of one statement's rows (configs, decisions, a deployment's inputs: kilobytes
    that every plan of a deployment, often of a batch, repeats), each written once: its first
    parameter is `json()`, the texts as a JSON array, which PostgreSQL parses once (`_PG_TEXTS`),
    and a row holds its texts' positions there. Parsing every row's own copy of them was a third
    of the database's CPU a plan (batches of 20 plans of new deployments, measured)."""

    __slots__ = ("_texts", "_position", "_rows")

    def __init__(self):
        self._texts: list[str] = []
        self._position: dict[str, int] = {}
        self._rows: dict[tuple, str] = {}   # a row's texts -> their positions, as its JSON row's tail

    def positions(self, texts: tuple) -> str:
        """`texts` (None: no text) as their positions, comma-separated (null for None)."""
        tail = self._rows.get(texts)
        if tail is None:
            tail = self._rows[texts] = ",".join(["null" if t is None else str(self._at(t)) for t in texts])
        return tail

    def _at(self, text: str) -> int:
        at = self._position.get(text)
        if at is None:
            at = self._position[text] = len(self._texts)
            self._texts.append(text)
        return at

    def json(self) -> str:
        return f"[{','.join([_literal(t) for t in self._texts])}]"


def _json_params(layout: str, rows: Iterable[tuple]) -> tuple[str, str]:
    """The parameters of `_PG_INSERT_PLANS` or `_PG_INSERT_PINS` for `rows`: their texts, their JSON rows."""
    texts = _BatchTexts()
    rows_json = _json_rows(layout, rows, texts)
    return texts.json(), rows_json


def _json_getters(layout: str) -> tuple[Callable[[tuple], tuple], Callable[[tuple], tuple]]:
    """(the short values of a row, its long texts), each as a tuple in `_JSON_ORDER` order, for `_json_rows`."""
    cols = _ROW_LAYOUTS[layout]
    short = [i for i, c in enumerate(cols) if c not in _LONG_TEXTS[layout]]
    long = [cols.index(c) for c in _LONG_TEXTS[layout]]
    assert len(short) > 1 and long, "itemgetter of one index answers the value, not a tuple"
    return operator.itemgetter(*short), (operator.itemgetter(*long) if len(long) > 1
                                         else lambda row, i=long[0]: (row[i],))


_JSON_GETTERS = {layout: _json_getters(layout) for layout in _ROW_LAYOUTS}


def _time_text(value: Any) -> str:
    """What `_dumps_short` writes for a value JSON has no type for: a time as ISO 8601 (what the
    statement casts to timestamptz); anything else is refused, as `json` refuses it."""
    return value.isoformat() if isinstance(value, dt.datetime) else _unserializable(value)


_dumps_short = _json_encoder(_time_text)
# JSON string literals of long texts seen lately, by text (a str caches its hash, and the texts
# that repeat are mostly the same objects: the transport's config texts, `_DECISIONS_JSON`'s).
_LITERALS: Memo[str] = Memo(_dumps)


def _literal(text: str | None) -> str:
    """`_dumps(text)`, remembered for texts that repeat."""
    return "null" if text is None else _LITERALS(text)



def _aware(value: dt.datetime | None) -> None:
    # What models.UTCDateTime refuses; the PostgreSQL batch statements bypass its bind step.
    if value is not None and (value.tzinfo is None or value.utcoffset() is None):
        raise ValueError(f"naive datetime {value!r}: the store keeps timezone-aware UTC times only")


_RUNTIME_FIELDS = tuple(f.name for f in dataclasses.fields(Runtime))


def _runtime_json(rt: Runtime) -> str:
    """`plans.runtime_json`: `dataclasses.asdict(rt)` as JSON (Runtime holds scalars)."""
    return _dumps({f: getattr(rt, f) for f in _RUNTIME_FIELDS})


# Runtime is a frozen dataclass that the transport shares between the requests that carry the same one.
_shared_runtime_json: ByIdentity[str] = ByIdentity(_runtime_json)


def _inputs_json(inputs: Mapping[str, Any]) -> str:
    """`deployment_pins.inputs_json` (and what a rank's inputs are compared with): the JSON of
    `NewPlan.deployment_inputs`, remembered for the read-only views the rules cache shares
    between the ranks of a deployment (`Resolution.deployment_inputs`), which nobody changes.
    By identity, not by value: inputs equal as Python values (1 == 1.0 == True) may be different JSON."""
    if is_shared_view(inputs):
        return _shared_inputs_json(inputs)
    return _dumps(inputs)


_shared_inputs_json: ByIdentity[str] = ByIdentity(lambda view: _dumps(dict(view)))


class _Pin(NamedTuple):
    deployment_id: str
    role: str
    plan_id: str          # the first rank's plan
    inputs_json: str


class _PinCache:
    """(deployment, role) -> its pin, for pins known committed. Written by the batch leader only."""

    def __init__(self, size: int):
        self.size = size
        self._pins: dict[tuple[str, str], _Pin] = {}
        self._lock = threading.Lock()

    def get(self, group: tuple[str, str]) -> _Pin | None:
        return self._pins.get(group)

    def remember(self, pins: Iterable[_Pin]) -> None:
        with self._lock:
            for pin in pins:
                self._pins[(pin.deployment_id, pin.role)] = pin
            while len(self._pins) > self.size:
                del self._pins[next(iter(self._pins))]


class _Item:
    """One plan of a batch and what its statements need, computed once."""

    __slots__ = ("new", "request_id", "group", "inputs_json")

    def __init__(self, new: NewPlan):
        req = new.plan.request
        _aware(new.plan.created_at)
        self.new = new
        self.request_id = req.request_id
        self.group = (req.deployment_id, req.role)
        self.inputs_json = _inputs_json(new.deployment_inputs)

    def as_pin(self) -> _Pin:
        return _Pin(self.group[0], self.group[1], self.new.plan.plan_id, self.inputs_json)

    def plan_row(self) -> tuple:
        """The plan's row in `_ROW_LAYOUTS["plans"]` order: everything its request is rebuilt from,
        and its decisions (`decisions_json`)."""
        new = self.new
        plan = new.plan
        req = plan.request
        p = req.parallel
        qc = req.quantization_config
        config_json = new.config_json if new.config_json is not None else _dumps(dict(req.config))
        qc_json = (new.quantization_config_json if new.quantization_config_json is not None
                   else None if qc is None else _dumps(dict(qc)))
        return (plan.plan_id, req.request_id, new.request_fingerprint, req.deployment_id, req.role, req.host,
                p.tp_size, p.tp_rank, p.ep_size, p.ep_rank, p.pp_size, p.pp_rank, p.dp_size, p.dp_rank,
                plan.entry_class, plan.config_fingerprint, config_json, plan.quantization,
                req.quantization, qc_json, _shared_runtime_json(req.runtime), plan.ruleset_version,
                plan.created_at, _new_decisions_json(new))

    def plan_json(self, texts: "_BatchTexts") -> str:
        """The plan's JSON row, as `_json_rows` writes it; for a plan made like another one
        (`NewPlan.like`), its own values joined to that one's (`_PlanRowTemplate`)."""
        new = self.new
        if new.like is None:
            return _json_row("plans", self.plan_row(), texts)
        template = _plan_row_template(new.like)
        plan = new.plan
        req = plan.request
        own = _dumps_short((plan.plan_id, req.request_id, new.request_fingerprint, req.deployment_id))
        return f'{own[:-1]}, {template.middle}, {_dumps_short(plan.created_at)},{texts.positions(template.long)}]'

    def pin_row(self) -> tuple:
        plan = self.new.plan
        return (self.group[0], self.group[1], self.inputs_json, plan.ruleset_version, plan.plan_id, plan.created_at)


def _decisions_json(plan: LoadPlan) -> str:
    """`plans.decisions_json` of a new plan: [[key, value, reason, rule, deployment_wide], ...].
    A resolved decision is revision 0, decided when its plan was created: what the column
    leaves out, so a decision that is not is refused rather than stored altered."""
    at = plan.created_at
    out = []
    for d in plan.decisions.values():
        if d.decided_at is None:
            raise ValueError(f"decision {d.key} has no decided_at")
        if d.decided_at != at or d.revision != 0:
            raise ValueError(f"decision {d.key}: a new plan's decisions are revision 0 decided at its created_at "
                             f"({at}), got revision {d.revision} decided at {d.decided_at}")
        out.append(_decision_fields(d))
    return _dumps(out)


def _decision_fields(d: Decision) -> list:
    return [d.key, d.value, d.reason, d.rule, d.deployment_wide]


class _SharedDecisionsJson:
    """`_decisions_json` of a new plan from its unstamped decisions (`NewPlan.unstamped`), by the
    identity of the decision objects, which the rules cache shares between the plans of a
    deployment (of every deployment of one config): encoded once, not for every plan. Each
    entry holds its objects, so their ids cannot be reused while it is remembered. The rules
    cache's read-only view of them (`Resolution.decisions`) is remembered by its own identity."""

    def __init__(self, maxsize: int = 4096):
        self.maxsize = maxsize
        self.memo: dict[tuple[int, ...], tuple[tuple[Decision, ...], str]] = {}
        self.views: ByIdentity[str] = ByIdentity(lambda view: self._encode(tuple(view.values())), maxsize)

    def __call__(self, unstamped: Mapping[str, Decision]) -> str:
        if is_shared_view(unstamped):
            return self.views(unstamped)
        decisions = tuple(unstamped.values())
        key = tuple(map(id, decisions))
        hit = self.memo.get(key)
        if hit is not None:
            return hit[1]
        text = self._encode(decisions)
        if len(self.memo) >= self.maxsize:
            self.memo.clear()
        self.memo[key] = (decisions, text)
        return text

    @staticmethod
    def _encode(decisions: tuple[Decision, ...]) -> str:
        for d in decisions:
            if d.decided_at is not None or d.revision != 0:
                raise ValueError(f"decision {d.key}: unstamped decisions of a new plan are revision 0 without "
                                 f"decided_at, got revision {d.revision} decided at {d.decided_at}")
        return _dumps([_decision_fields(d) for d in decisions])


_DECISIONS_JSON = _SharedDecisionsJson()


def _new_decisions_json(new: NewPlan) -> str:
    """`plans.decisions_json` of `new`: its unstamped decisions' (remembered) when it has them,
    which stamping leaves the same (the column has no decided_at), else its plan's."""
    unstamped = new.unstamped
    if unstamped is None:
        return _decisions_json(new.plan)
    if len(unstamped) != len(new.plan.decisions):
        raise ValueError(f"NewPlan.unstamped has {len(unstamped)} decisions, its plan {len(new.plan.decisions)}")
    return _DECISIONS_JSON(unstamped)


def _pin_refusal(item: _Item, pin: _Pin) -> FailedPrecondition | None:
    """The refusal of a plan whose deployment-wide inputs differ from its (deployment, role)'s pin."""
    if item.inputs_json == pin.inputs_json:
        return None   # the same JSON: the same inputs (the common case, no parsing)
    pinned = json.loads(pin.inputs_json)
    mine = item.new.deployment_inputs
    differing = diff_deployment_inputs(pinned, mine)
    if not differing:
        return None
    details = "; ".join(f"{k}: pinned {pinned.get(k)!r}, this rank {mine.get(k)!r}" for k in differing)
    return FailedPrecondition(
        f"deployment {item.group[0]!r} role {item.group[1]!r} is pinned by its first rank (plan "
        f"{pin.plan_id}) to different deployment-wide inputs; every rank must agree on "
        f"{', '.join(differing)} ({details})", field=differing[0])


class SqlPlanStore:
    """`PlanStore` on SQLite or PostgreSQL; `engine` from `db.make_engine`, migrated to head."""

    def __init__(self, engine: Engine, *, max_batch: int = MAX_BATCH, max_batches_in_flight: int | None = None,
                 pin_cache_size: int = PIN_CACHE_SIZE, wait_timeout_s: float | None = -1.0):
        self.engine = engine
        self._writer = writer(engine)
        self._pg = engine.dialect.name == "postgresql"
        if max_batches_in_flight is None:
            # SQLite writes one transaction at a time anyway.
            max_batches_in_flight = PG_BATCHES_IN_FLIGHT if self._pg else 1
        if wait_timeout_s is not None and wait_timeout_s < 0:
            # A plan waiting behind a batch that hangs gives up (UNAVAILABLE) once that batch and
            # its own would have been cut short by the engine's bound on each database call.
            bound = operation_timeout(engine)
            wait_timeout_s = None if bound is None else WAIT_TIMEOUT_CALLS * bound
        self.wait_timeout_s = wait_timeout_s
        self._group: GroupCommit[NewPlan] = GroupCommit(self._save_batch, max_batch=max_batch,
                                                        max_leaders=max_batches_in_flight, timeout=wait_timeout_s)
        self._pins = _PinCache(pin_cache_size)
        self._bind_processors: dict[str, list] = {}

    def async_writer(self, executor=None, **options):
        """`save_plan` for the coroutines of the running event loop (service/store/async_writer.py):
        on PostgreSQL a `PgAsyncWriter`, which writes from the loop; on SQLite, whose driver
        blocks, batches written by `_save_batch` on a thread of `executor` (one hand-off per batch).
        `executor` also runs PostgreSQL's careful path; `options` go to the writer."""
        from .async_writer import ThreadedPlanWriter

        if not self._pg:
            return ThreadedPlanWriter(self, executor, max_batch=self._group.max_batch, **options)
        from .pg_async_writer import PgAsyncWriter   # psycopg's asyncio side: only where it is used

        return PgAsyncWriter(self, executor, max_batch=self._group.max_batch, **options)

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
        """One plan, written in the group commit of every plan saved at the same time."""
        try:
            return self._group.submit(new)
        except GroupCommitTimeout as err:
            raise Unavailable(f"database not answering while saving a plan ({err}); retry with the same "
                              f"request id") from None

    def _save_batch(self, news: Sequence[NewPlan]) -> list[Any]:
        """The `GroupCommit` writer: one outcome (plan, exception or DEFER) per plan, after COMMIT."""
        outcomes, todo, items = self._batch_items(news)
        if not items:
            return outcomes
        try:
            results = self._write_batch(items)
        except Unavailable as err:
            # Nothing of the batch is known committed: each caller retries with its request id.
            results = [Unavailable(err.message) for _ in items]
        except Exception as err:  # noqa: BLE001 - a plan the database refuses must not fail the others
            results = [err] if len(items) == 1 else [self._write_alone(item) for item in items]
        for i, result in zip(todo, results):
            outcomes[i] = result
        return outcomes

    @staticmethod
    def _batch_items(news: Sequence[NewPlan]) -> tuple[list[Any], list[int], list["_Item"]]:
        """(outcomes, the positions to write, their items): the first plan of each request id; a
        second one with the same id is DEFERred to the next batch, where it sees the first one's
        outcome in the database (a replay or a refusal); a plan whose item cannot be built (e.g. a
        naive time) gets its own error."""
        outcomes: list[Any] = [DEFER] * len(news)
        firsts: dict[str, int] = {}
        for i, new in enumerate(news):
            firsts.setdefault(new.plan.request.request_id, i)
        todo, items = [], []
        for i in sorted(firsts.values()):
            try:
                items.append(_Item(news[i]))
            except Exception as err:  # noqa: BLE001 - this caller's own error
                outcomes[i] = err
                continue
            todo.append(i)
        return outcomes, todo, items

    def _write_alone(self, item: "_Item") -> Any:
        try:
            return self._write_batch([item])[0]
        except Exception as err:  # noqa: BLE001 - this caller's own answer
            return err

    def _write_batch(self, items: list["_Item"]) -> list[Any]:
        """Write `items`; one outcome each. PostgreSQL first tries the optimistic way (`_pg_fast`:
        one statement, no look-ups); what it leaves, and everything on SQLite (whose write lock,
        BEGIN IMMEDIATE, makes its look-ups exact), goes the careful way (`_write_carefully`)."""
        if not self._pg:
            return self._write_carefully(items)
        try:
            with _translate_errors("saving a plan"):
                results, pinned, left = self._pg_fast(items)
        except _Retry:   # a stored request id, a deadlock: nothing of the statement was written
            return self._write_carefully(items)
        self._pins.remember(pinned)   # committed with the statement
        if left:
            for k, result in zip(left, self._write_carefully([items[k] for k in left])):
                results[k] = result
        return results

    def _pg_fast(self, items: list["_Item"]) -> tuple[list[Any], list[_Pin], list[int]]:
        """The optimistic way on PostgreSQL: `_PG_SAVE`, one autocommitted statement for the batch.
        Returns (outcomes, the pins it set, the items it left to the careful way: every one that
        might be refused or replayed, and the plans of a pin somebody else set meanwhile)."""
        fast = self.fast_statement(items)
        inserted = None
        if fast.sql is not None:
            with self.engine.connect() as conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                result = conn.exec_driver_sql(fast.sql, fast.params)
                if fast.returns_plan_ids:
                    inserted = {r[0] for r in result}
        return self.fast_outcomes(items, fast, inserted)

    def fast_statement(self, items: list["_Item"]) -> "FastStatement":
        """The optimistic statement for `items` (what `_pg_fast` runs; `PgAsyncWriter` too): the
        plans whose pin is known to agree (`_PinCache`) or set by this batch, and the pins it sets.
        Inputs whose JSON differs from the pin's may still be the same inputs, or be refused, or
        replay: those are left to the careful way. `sql` is None when nothing is left to write."""
        left: list[int] = []
        setters: dict[tuple[str, str], int] = {}   # group -> the item that sets its pin
        writes: list[int] = []
        for k, item in enumerate(items):
            pin = self._pins.get(item.group)
            if pin is not None:
                ok = item.inputs_json == pin.inputs_json
            elif item.group in setters:
                ok = item.inputs_json == items[setters[item.group]].inputs_json
            else:
                setters[item.group] = k
                ok = True
            (writes if ok else left).append(k)
        if not writes:
            return FastStatement(writes, left, [], None, ())
        plans = sorted((items[k] for k in writes), key=lambda it: it.request_id)   # one lock order
        pins = sorted((items[k] for k in setters.values()), key=lambda it: it.group)
        if len(plans) == 1:
            row = plans[0].plan_row()
            if not pins:
                return FastStatement(writes, left, [], _PG_INSERT_ONE_PLAN, row)
            return FastStatement(writes, left, pins, _PG_SAVE_ONE, (*pins[0].pin_row(), *row))
        texts = _BatchTexts()
        plans_json = f"[{','.join([it.plan_json(texts) for it in plans])}]"
        if not pins:   # ranks of known deployments only (the common case): the plans alone
            return FastStatement(writes, left, [], _PG_INSERT_PLANS, (texts.json(), plans_json))
        pins_json = _json_rows("deployment_pins", [it.pin_row() for it in pins], texts)
        return FastStatement(writes, left, pins, _PG_SAVE, (texts.json(), pins_json, plans_json))

    @staticmethod
    def fast_outcomes(items: list["_Item"], fast: "FastStatement",
                      inserted: set[str] | None) -> tuple[list[Any], list[_Pin], list[int]]:
        """After `fast` ran (committed): (outcomes, the pins it set, the items left to the careful
        way). `inserted`: the plan ids `_PG_SAVE` returned (None: a plain insert, all of them)."""
        results: list[Any] = [None] * len(items)
        left = list(fast.left)
        for k in fast.writes:
            plan = items[k].new.plan
            if inserted is None or plan.plan_id in inserted:
                results[k] = plan
            else:
                left.append(k)
        pinned = [it.as_pin() for it in fast.pins if inserted is None or it.new.plan.plan_id in inserted]
        return results, pinned, sorted(left)

    def _write_carefully(self, items: list["_Item"]) -> list[Any]:
        """Write `items` in one transaction after looking up their request ids and pins; started over
        as a whole when it lost a race to another writer."""
        last: BaseException | None = None
        for _ in range(MAX_ATTEMPTS):
            try:
                with _translate_errors("saving a plan"), self.unit_of_work(write=True) as uow:
                    results, pinned = self._attempt(uow.conn, items)
                    uow.commit()
            except _Retry as err:
                last = err.__cause__ or err
                continue
            self._pins.remember(pinned)   # only now: they are committed
            return results
        raise Unavailable(f"database contention while saving a plan: gave up after {MAX_ATTEMPTS} attempts "
                          f"({_short(last) if last else 'unknown'}); retry with the same request id")

    def _attempt(self, conn: Connection, items: list["_Item"]):
        """One try of a batch in the open transaction of `conn`: (outcomes, pins it wrote).

        Equivalent to saving the plans one after the other in batch order: a stored request id
        replays (or is refused), and each (deployment, role) is pinned by the first plan that
        writes it, the database's pin or the batch's first one. Refusals are decided here, before
        anything is written, so a refused plan costs the others nothing."""
        results: list[Any] = [None] * len(items)
        replays: dict[int, str] = {}             # item -> stored plan id
        self._classify_stored(conn, items, list(range(len(items))), results, replays)
        live = [k for k in range(len(items)) if results[k] is None and k not in replays]

        pins: dict[tuple[str, str], _Pin] = {}
        missing = []
        for k in live:
            g = items[k].group
            if g not in pins:
                pin = self._pins.get(g)
                if pin is None:
                    missing.append(g)
                else:
                    pins[g] = pin
        if missing:
            read = self._select_pins(conn, missing)
            self._pins.remember(read.values())   # committed by someone: safe to keep
            pins.update(read)

        setters: dict[tuple[str, str], int] = {}   # group -> the item that sets its pin
        writes: list[int] = []
        for k in live:
            item = items[k]
            pin = pins.get(item.group)
            if pin is None:
                setter = setters.get(item.group)
                if setter is None:
                    setters[item.group] = k
                    writes.append(k)
                    continue
                pin = items[setter].as_pin()
            refusal = _pin_refusal(item, pin)
            if refusal is None:
                writes.append(k)
            else:
                results[k] = refusal

        written: list[_Pin] = []
        if writes:
            setter_items = [items[k] for k in setters.values()]
            if self._pg:
                inserted = self._pg_insert(conn, [items[k] for k in writes], setter_items)
            else:
                self._insert_plans(conn, [items[k] for k in writes])
                inserted = self._insert_pins(conn, setter_items)
            lost = [it.group for it in setter_items if it.group not in inserted]
            if lost:
                # Another writer pinned these since we looked (or before: a pin this process had
                # not seen). Ours agree with it: keep them. One does not: start over, refusing it.
                read = self._select_pins(conn, lost)
                self._pins.remember(read.values())
                if len(read) < len(lost) or any(_pin_refusal(items[k], read[items[k].group]) is not None
                                                for k in writes if items[k].group in read):
                    raise _Retry()
            written = [it.as_pin() for it in setter_items if it.group in inserted]
            for k in writes:
                results[k] = items[k].new.plan
        if replays:
            loaded = self._load_plans(conn, sorted(set(replays.values())), replayed=True)
            for k, plan_id in replays.items():
                results[k] = loaded[plan_id]
        return results, written

    # --- the statements of a batch --------------------------------------------------
    # Plain SQL through `exec_driver_sql`: no statement is built or compiled per batch
    # (building Core statements cost more CPU than the database spent on them).

    def _classify_stored(self, conn: Connection, items: list["_Item"], which: list[int], results: list[Any],
                         replays: dict[int, str]) -> None:
        """Items whose request id is stored: a replay when the request is the same, else refused."""
        stored = {}
        for chunk in _chunks([items[k].request_id for k in which], _LOOKUP_CHUNK):
            if self._pg:
                rows = conn.exec_driver_sql(_PG_SELECT_REQUESTS, ([*chunk],))
            else:
                rows = conn.exec_driver_sql(_SQLITE_SELECT_REQUESTS.format(", ".join("?" * len(chunk))),
                                            tuple(chunk))
            stored.update((r[0], r) for r in rows)
        for k in which:
            row = stored.get(items[k].request_id)
            if row is None:
                continue
            _, plan_id, request_fingerprint = row
            if request_fingerprint == items[k].new.request_fingerprint:
                replays[k] = plan_id
            else:
                results[k] = FailedPrecondition(
                    f"request_id {items[k].request_id!r} was used for a different request (plan {plan_id}); "
                    f"a retry must repeat the request exactly, a new request needs a new request_id",
                    field="request_id")

    def _select_pins(self, conn: Connection, groups: list[tuple[str, str]]) -> dict[tuple[str, str], "_Pin"]:
        found: dict[tuple[str, str], _Pin] = {}
        for chunk in _chunks(sorted(set(groups)), _LOOKUP_CHUNK):
            if self._pg:
                rows = conn.exec_driver_sql(_PG_SELECT_PINS, ([g[0] for g in chunk], [g[1] for g in chunk]))
            else:
                rows = conn.exec_driver_sql(_SQLITE_SELECT_PINS.format(", ".join(["(?, ?)"] * len(chunk))),
                                            tuple(x for g in chunk for x in g))
            for r in rows:
                found[(r[0], r[1])] = _Pin(*r)
        return found

    def _insert_plans(self, conn: Connection, items: list["_Item"]) -> None:
        """The plan rows and their decisions. A stored request id fails it (unique violation):
        the batch starts over carefully and replays that plan."""
        items = sorted(items, key=lambda it: it.request_id)   # one lock order for every writer
        plans = [it.plan_row() for it in items]
        if self._pg:
            conn.exec_driver_sql(_PG_INSERT_PLANS, _json_params("plans", plans))
        else:
            conn.exec_driver_sql(_SQLITE_INSERT["plans"], self._sqlite_rows(PLANS, plans))

    def _pg_insert(self, conn: Connection, items: list["_Item"], setters: list["_Item"]) -> set[tuple[str, str]]:
        """PostgreSQL: `_insert_plans` and `_insert_pins` in ONE round trip (psycopg pipeline mode:
        the transaction's BEGIN and both statements go out together, the answers come back
        together). The statements still go through SQLAlchemy (its events, its error types);
        the pins' RETURNING rows are read from the cursor once the pipeline has synced."""
        import psycopg

        raw = conn.connection.dbapi_connection
        try:
            begin = borrow_autocommit(raw)
            with raw.pipeline():
                if begin:
                    raw.execute("BEGIN")
                self._insert_plans(conn, items)
                result = self._send_pins(conn, setters)
                # The statements returned at once; the wait is at the sync this block ends with.
                arm_watchdog(self.engine, raw)
        except psycopg.Error as err:
            # Raised when the pipeline syncs, outside SQLAlchemy's execute: translated the same way.
            raise sa_exc.DBAPIError.instance(None, None, err, psycopg.Error,
                                             connection_invalidated=raw.closed or raw.broken) from err
        finally:
            WATCHDOG.disarm(raw)
        if result is None:
            return set()
        res = result.context.cursor.pgresult   # SQLAlchemy closed its cursor before the rows came
        return {(res.get_value(i, 0).decode(), res.get_value(i, 1).decode()) for i in range(res.ntuples)}

    def _send_pins(self, conn: Connection, items: list["_Item"]):
        if not items:
            return None
        rows = [it.pin_row() for it in sorted(items, key=lambda it: it.group)]
        return conn.exec_driver_sql(_PG_INSERT_PINS, _json_params("deployment_pins", rows))

    def _insert_pins(self, conn: Connection, items: list["_Item"]) -> set[tuple[str, str]]:
        """Pin each item's (deployment, role) to its inputs unless pinned already; the ones it pinned."""
        if not items:
            return set()
        items = sorted(items, key=lambda it: it.group)
        rows = [it.pin_row() for it in items]
        if self._pg:
            result = conn.exec_driver_sql(_PG_INSERT_PINS, _json_params("deployment_pins", rows))
            return {(r[0], r[1]) for r in result}
        # SQLite: the write lock is held and the pins were looked up in this transaction.
        conn.exec_driver_sql(_SQLITE_INSERT["deployment_pins"], self._sqlite_rows(PINS, rows))
        return {it.group for it in items}

    def _sqlite_rows(self, table: sa.Table, rows: list[tuple]) -> list[tuple]:
        """Rows as the column types store them on SQLite (UTC times as text, booleans as 0/1)."""
        processors = self._bind_processors.get(table.name)
        if processors is None:
            processors = self._bind_processors[table.name] = [
                (i, p) for i, c in enumerate(table.columns)
                if (p := c.type.dialect_impl(self.engine.dialect).bind_processor(self.engine.dialect))]
        if not processors:
            return rows
        out = []
        for row in rows:
            row = list(row)
            for i, process in processors:
                row[i] = process(row[i])
            out.append(tuple(row))
        return out

    def _load_plans(self, conn: Connection, plan_ids: list[str], *, replayed: bool) -> dict[str, LoadPlan]:
        rows = conn.execute(sa.select(PLANS).where(PLANS.c.plan_id.in_(plan_ids))).all()
        decisions = self._decisions_of(conn, plan_ids)
        return {r.plan_id: _load_plan(r, decisions[r.plan_id], include_history=False, replayed=replayed)
                for r in rows}

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
