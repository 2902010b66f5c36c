"""Engines and migrations for the history database.

`make_engine(url)` is the one place that knows the two supported databases:
- SQLite (the embedded default): WAL so readers never block the writer, a busy
  timeout, foreign keys on, and write transactions that take the write lock
  up front (BEGIN IMMEDIATE). A deferred transaction that reads and then writes
  can fail with "database is locked" when another writer got in between; with
  IMMEDIATE concurrent writers queue on the busy timeout instead.
- PostgreSQL through psycopg 3 (`postgresql+psycopg://`; `postgresql://` and
  `postgres://` are rewritten to it), with every wait bounded: a database that
  stops answering (a partition: connections open, no reply, no RST) must turn
  into errors (UNAVAILABLE, NOT_SERVING) within seconds, not hang the registry.
  libpq's connect_timeout bounds connecting, TCP keepalives and
  tcp_user_timeout let the kernel drop a dead peer, statement_timeout bounds the
  server's side; and since none of these fires when the bytes are acknowledged
  but never answered (a stalled server, a proxy), a watchdog shuts down the
  socket of any statement, commit, rollback or ping that runs longer than
  `operation_timeout_s` (the blocked call then fails at once with a connection
  error, and the pool drops that connection).

`migrate(url)` upgrades to head programmatically (the CLI's `loadplan migrate`);
`is_at_head(engine)` is what readiness asks.
"""

from __future__ import annotations

import functools
import os
import pathlib
import socket
import threading
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url

# Connection option that marks a write transaction (see `_sqlite_begin`).
WRITE_OPTION = "loadplan_write"
SQLITE_BUSY_TIMEOUT_S = 30
# PostgreSQL: longest a statement, commit, rollback or ping may take before its connection is
# shut down (and the call fails UNAVAILABLE); a client's deadline is typically 10 s or more.
DEFAULT_OPERATION_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 3                 # libpq: integer seconds, at least 2
# A pooled connection idle longer than this is pinged (under the watchdog) before use; one used
# more recently is trusted, saving a round trip per transaction under load. A connection that
# died meanwhile fails its first statement UNAVAILABLE, and the pool drops every older one.
PING_IF_IDLE_S = 1.0
SUPPORTED_URLS = "sqlite:///PATH, postgresql+psycopg://USER@HOST:PORT/DB (postgresql:// and postgres:// also accepted)"


def normalize_url(url: str | sa.URL) -> sa.URL:
    """Parse a database URL and point PostgreSQL at the psycopg 3 driver."""
    try:
        u = make_url(url) if isinstance(url, str) else url
    except Exception as exc:   # sqlalchemy raises ArgumentError; keep the message actionable
        raise ValueError(f"database URL {str(url)!r} is not a URL; supported: {SUPPORTED_URLS}") from exc
    if u.drivername in ("postgresql", "postgres", "postgresql+psycopg"):
        return u.set(drivername="postgresql+psycopg")
    if u.drivername in ("sqlite", "sqlite+pysqlite"):
        return u
    raise ValueError(f"database {u.drivername!r} not supported; supported: {SUPPORTED_URLS}")


def make_engine(url: str | sa.URL, *, operation_timeout_s: float | None = DEFAULT_OPERATION_TIMEOUT_S,
                **kwargs: Any) -> Engine:
    """An engine configured for the registry; `kwargs` go to `create_engine` (e.g. pool sizes).

    PostgreSQL: `operation_timeout_s` bounds every statement, commit, rollback and ping (the
    server's statement_timeout and this process's watchdog); None: unbounded (migrations)."""
    u = normalize_url(url)
    if u.get_backend_name() == "sqlite":
        connect_args = kwargs.pop("connect_args", {})
        connect_args.setdefault("timeout", SQLITE_BUSY_TIMEOUT_S)
        engine = sa.create_engine(u, connect_args=connect_args, **kwargs)
        _install_sqlite_hooks(engine)
        return engine
    connect_args = dict(kwargs.pop("connect_args", {}))
    if "connect_timeout" not in u.query:
        connect_args.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
    if operation_timeout_s is None:
        kwargs.setdefault("pool_pre_ping", True)
        engine = sa.create_engine(u, connect_args=connect_args, **kwargs)
        return engine
    if operation_timeout_s <= 0:
        raise ValueError(f"operation_timeout_s must be > 0 or None, got {operation_timeout_s}")
    for key, value in (("keepalives", 1), ("keepalives_idle", 5), ("keepalives_interval", 2),
                       ("keepalives_count", 3), ("tcp_user_timeout", int(operation_timeout_s * 1000))):
        if key not in u.query:
            connect_args.setdefault(key, value)
    timeout_ms = int(operation_timeout_s * 1000)
    options = connect_args.get("options") or u.query.get("options") or ""
    if "statement_timeout" not in options:
        connect_args["options"] = f"{options} -c statement_timeout={timeout_ms}".strip()
    # The ping is ours (`_install_pg_guards`): under the watchdog, and only for idle connections.
    kwargs["pool_pre_ping"] = False
    engine = sa.create_engine(u, connect_args=connect_args, **kwargs)
    _install_pg_guards(engine, operation_timeout_s)
    return engine


class _Watchdog:
    """Shuts down the socket of a database call that overran its deadline.

    `arm(conn, seconds)` before a call, `disarm(conn)` after it (a dict store each: cheap
    enough for every statement). One daemon thread for the process looks about 5 times a
    second; a socket shut down under a blocked psycopg call wakes it with a connection
    error, which SQLAlchemy and the store treat as the database being unavailable."""

    TICK_S = 0.2

    def __init__(self):
        self._armed: dict[int, tuple[float, Any]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.fired = 0                    # calls cut short (for tests and logs)

    def arm(self, dbapi_conn: Any, seconds: float) -> None:
        self._armed[id(dbapi_conn)] = (time.monotonic() + seconds, dbapi_conn)
        if self._thread is None:
            self._start()

    def disarm(self, dbapi_conn: Any) -> None:
        self._armed.pop(id(dbapi_conn), None)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="loadplan-db-watchdog", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.TICK_S)
            now = time.monotonic()
            for key, (deadline, conn) in list(self._armed.items()):
                if deadline <= now and self._armed.get(key, (None,))[0] == deadline:
                    self._armed.pop(key, None)
                    self.fired += 1
                    shut_down_socket(conn)


def shut_down_socket(dbapi_conn: Any) -> None:
    """Shut the connection's socket down both ways (not close: the fd stays psycopg's)."""
    try:
        fd = dbapi_conn.pgconn.socket
    except Exception:  # noqa: BLE001 - closed already, or not psycopg: nothing to cut
        return
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()


WATCHDOG = _Watchdog()


def _install_pg_guards(engine: Engine, seconds: float) -> None:
    """The watchdog over every statement, commit, rollback and ping of `engine`."""
    dialect = engine.dialect
    dialect.loadplan_operation_timeout_s = seconds

    def guarded(method):
        @functools.wraps(method)
        def call(dbapi_conn, *args, **kwargs):
            WATCHDOG.arm(dbapi_conn, seconds)
            try:
                return method(dbapi_conn, *args, **kwargs)
            finally:
                WATCHDOG.disarm(dbapi_conn)
        return call

    # Commits and rollbacks have no before/after event pair; the dialect's own methods do.
    dialect.do_commit = guarded(dialect.do_commit)
    dialect.do_rollback = guarded(dialect.do_rollback)

    @event.listens_for(engine, "before_cursor_execute")
    def _arm(conn, cursor, statement, parameters, context, executemany):
        WATCHDOG.arm(cursor.connection, seconds)

    @event.listens_for(engine, "after_cursor_execute")
    def _disarm(conn, cursor, statement, parameters, context, executemany):
        WATCHDOG.disarm(cursor.connection)

    @event.listens_for(engine, "handle_error")
    def _disarm_failed(ctx):
        cursor = getattr(ctx.execution_context, "cursor", None)
        if cursor is not None:
            WATCHDOG.disarm(cursor.connection)

    @event.listens_for(engine, "checkin")
    def _checked_in(dbapi_conn, record):
        WATCHDOG.disarm(dbapi_conn)
        record.info["loadplan_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_conn, record, proxy):
        since = record.info.get("loadplan_idle_since")
        if since is None or time.monotonic() - since < PING_IF_IDLE_S:
            return   # brand new, or used a moment ago
        WATCHDOG.arm(dbapi_conn, seconds)
        try:
            cur = dbapi_conn.cursor()
            try:
                cur.execute("SELECT 1")
            finally:
                cur.close()
            dbapi_conn.rollback()   # the ping opened a transaction (not autocommit)
        except Exception as err:
            # The pool retries the checkout on a fresh connection (SQLAlchemy's pessimistic recipe).
            raise sa.exc.DisconnectionError(f"pooled connection failed its ping: {err}") from err
        finally:
            WATCHDOG.disarm(dbapi_conn)


def _install_sqlite_hooks(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _sqlite_connect(dbapi_conn, _record):
        # Take BEGIN away from the sqlite3 module (it skips it for SELECT and DDL);
        # `_sqlite_begin` emits our own.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_S * 1000}")
            cur.execute("PRAGMA foreign_keys = ON")
            cur.execute("PRAGMA journal_mode = WAL")
            cur.execute("PRAGMA synchronous = NORMAL")   # durable at commit under WAL up to an OS crash
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _sqlite_begin(conn):
        immediate = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def operation_timeout(engine: Engine) -> float | None:
    """The bound `make_engine` put on each database call of `engine` (None: unbounded)."""
    return getattr(engine.dialect, "loadplan_operation_timeout_s", None)


def writer(engine: Engine) -> Engine:
    """The same engine (same pool), but its transactions are write transactions."""
    return engine.execution_options(**{WRITE_OPTION: True})


# --- migrations ------------------------------------------------------------------

def _migrations_dir() -> pathlib.Path:
    # The `loadplan.migrations` package holds env.py, alembic.ini and versions/,
    # installed or editable; never rely on the current directory.
    import loadplan.migrations as pkg
    return pathlib.Path(pkg.__file__).resolve().parent


def alembic_config(url: str | sa.URL | None = None):
    from alembic.config import Config

    here = _migrations_dir()
    cfg = Config(str(here / "alembic.ini"))
    cfg.set_main_option("script_location", str(here))
    if url is not None:
        # Through attributes, not the ini option: configparser would read '%' in a password.
        cfg.attributes["url"] = normalize_url(url)
    return cfg


@functools.lru_cache(maxsize=1)
def head_revisions() -> frozenset[str]:
    from alembic.script import ScriptDirectory

    return frozenset(ScriptDirectory.from_config(alembic_config()).get_heads())


def _run(url_or_engine: str | sa.URL | Engine, fn) -> None:
    # Unbounded: a migration's DDL may legitimately run long.
    engine = url_or_engine if isinstance(url_or_engine, Engine) else make_engine(url_or_engine,
                                                                                  operation_timeout_s=None)
    try:
        with writer(engine).begin() as conn:
            if conn.dialect.name == "postgresql":
                # Several replicas (or a migrate job racing a server) may migrate at once:
                # one at a time, the others then find the schema at head.
                conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7438211)")
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            fn(cfg)
    finally:
        if engine is not url_or_engine:
            engine.dispose()


def migrate(url_or_engine: str | sa.URL | Engine, revision: str = "head") -> None:
    """Upgrade the database to `revision` (head by default), in one transaction."""
    from alembic import command

    _run(url_or_engine, lambda cfg: command.upgrade(cfg, revision))


def downgrade(url_or_engine: str | sa.URL | Engine, revision: str = "base") -> None:
    from alembic import command

    _run(url_or_engine, lambda cfg: command.downgrade(cfg, revision))


# alembic's default name, which migrations/env.py keeps.
VERSION_TABLE = "alembic_version"


def current_revisions(engine: Engine) -> frozenset[str]:
    """The revisions the database carries (none: not migrated). Read from the version table
    directly: readiness asks every second, and alembic's MigrationContext logs a line at INFO
    each time it is built (two lines a second in the server's log)."""
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table(VERSION_TABLE):
            return frozenset()
        return frozenset(conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").scalars())


def is_at_head(engine: Engine) -> bool:
    """True iff the database answers and carries exactly the head revision(s). Never raises."""
    try:
        return current_revisions(engine) == head_revisions()
    except Exception:
        return False
