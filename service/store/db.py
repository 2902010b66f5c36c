"""Engines and migrations for the history database.

`make_engine(url)` is the one place that knows the two supported databases:
- SQLite (the embedded default): WAL so readers never block the writer, a busy
  timeout, foreign keys on, and write transactions that take the write lock
  up front (BEGIN IMMEDIATE). A deferred transaction that reads and then writes
  can fail with "database is locked" when another writer got in between; with
  IMMEDIATE concurrent writers queue on the busy timeout instead.
- PostgreSQL through psycopg 3 (`postgresql+psycopg://`; `postgresql://` and
  `postgres://` are rewritten to it).

`migrate(url)` upgrades to head programmatically (the CLI's `loadplan migrate`);
`is_at_head(engine)` is what readiness asks.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url

# Connection option that marks a write transaction (see `_sqlite_begin`).
WRITE_OPTION = "loadplan_write"
SQLITE_BUSY_TIMEOUT_S = 30
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


def make_engine(url: str | sa.URL, **kwargs: Any) -> Engine:
    """An engine configured for the registry; `kwargs` go to `create_engine` (e.g. pool sizes)."""
    u = normalize_url(url)
    if u.get_backend_name() == "sqlite":
        connect_args = kwargs.pop("connect_args", {})
        connect_args.setdefault("timeout", SQLITE_BUSY_TIMEOUT_S)
        engine = sa.create_engine(u, connect_args=connect_args, **kwargs)
        _install_sqlite_hooks(engine)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return sa.create_engine(u, **kwargs)


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
    engine = url_or_engine if isinstance(url_or_engine, Engine) else make_engine(url_or_engine)
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


def current_revisions(engine: Engine) -> frozenset[str]:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return frozenset(MigrationContext.configure(conn).get_current_heads())


def is_at_head(engine: Engine) -> bool:
    """True iff the database answers and carries exactly the head revision(s). Never raises."""
    try:
        return current_revisions(engine) == head_revisions()
    except Exception:
        return False
