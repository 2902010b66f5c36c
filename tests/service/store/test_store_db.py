"""Engines and migrations: service/store/db.py and migrations/."""

from __future__ import annotations

import logging
import sqlite3
import threading

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from loadplan.service.store.db import (
    current_revisions,
    downgrade,
    head_revisions,
    is_at_head,
    make_engine,
    migrate,
    normalize_url,
    writer,
)
from loadplan.service.store.models import Base
from store_helpers import TABLES


@pytest.mark.parametrize("url, driver", [
    ("postgresql://u@h:5432/db", "postgresql+psycopg"),
    ("postgres://u@h/db", "postgresql+psycopg"),
    ("postgresql+psycopg://u@h/db", "postgresql+psycopg"),
    ("sqlite:///registry.db", "sqlite"),
])
def test_urls_are_normalized(url, driver):
    u = normalize_url(url)
    assert u.drivername == driver
    assert u.database == url.rsplit("/", 1)[1]


@pytest.mark.parametrize("url", ["mysql://u@h/db", "postgresql+psycopg2://u@h/db", "not a url"])
def test_unsupported_urls_name_the_supported_ones(url):
    with pytest.raises(ValueError, match="supported: sqlite"):
        normalize_url(url)


def test_sqlite_connections_are_configured(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
    engine.dispose()


def test_sqlite_write_transactions_take_the_lock_up_front(tmp_path):
    path = tmp_path / "x.db"
    engine = make_engine(f"sqlite:///{path}")
    with writer(engine).begin() as conn:
        conn.exec_driver_sql("SELECT 1")   # a read only: a deferred BEGIN would not hold the lock yet
        probe = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                probe.execute("BEGIN IMMEDIATE")
            assert probe.execute("SELECT 1").fetchone() == (1,)   # WAL: readers still read
        finally:
            probe.close()
    # A read transaction does not block writers.
    with engine.begin() as conn:
        conn.exec_driver_sql("SELECT 1")
        probe = sqlite3.connect(path, timeout=0, isolation_level=None)
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        probe.close()
    engine.dispose()


def test_sqlite_concurrent_writers_queue_instead_of_failing(tmp_path):
    # Read-then-write transactions from many threads: with deferred BEGIN, the
    # upgrade from reader to writer fails with "database is locked" at once.
    engine = make_engine(f"sqlite:///{tmp_path / 'x.db'}", pool_size=8)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE counter (n INTEGER)")
        conn.exec_driver_sql("INSERT INTO counter VALUES (0)")
    errors: list[BaseException] = []

    def bump():
        try:
            for _ in range(10):
                with writer(engine).begin() as conn:
                    n = conn.exec_driver_sql("SELECT n FROM counter").scalar()
                    conn.exec_driver_sql(f"UPDATE counter SET n = {n + 1}")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=bump) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT n FROM counter").scalar() == 80   # no lost update
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request, tmp_path):
    """A fresh, unmigrated database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    return request.getfixturevalue("make_postgres_database")()


def _tables(engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def test_migrate_up_down_up(empty_url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the migrations are found from the package, not the current directory
    engine = make_engine(empty_url)
    assert not is_at_head(engine)
    assert current_revisions(engine) == frozenset()

    migrate(empty_url)
    assert is_at_head(engine)
    assert current_revisions(engine) == head_revisions()
    assert set(TABLES) <= _tables(engine)

    migrate(empty_url)   # at head already: a no-op
    assert is_at_head(engine)


def test_readiness_question_writes_nothing_to_the_log(empty_url, caplog):
    """The server asks `is_at_head` every second: it must not log a line each time."""
    migrate(empty_url)
    engine = make_engine(empty_url)
    caplog.set_level(logging.DEBUG)
    assert is_at_head(engine)
    assert current_revisions(engine) == head_revisions()
    assert [r.getMessage() for r in caplog.records if not r.name.startswith("sqlalchemy")] == []
    engine.dispose()

    downgrade(empty_url, "base")
    assert not is_at_head(engine)
    assert not set(TABLES) & _tables(engine)

    migrate(engine)      # an engine works as well as a URL
    assert is_at_head(engine)
    engine.dispose()


def test_migrated_schema_matches_the_models(db_engine):
    with db_engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
        assert compare_metadata(ctx, Base.metadata) == []


def test_constraints_follow_the_naming_convention(db_engine):
    insp = sa.inspect(db_engine)
    assert [u["name"] for u in insp.get_unique_constraints("plans")] == ["uq_plans_request_id"]
    assert {fk["name"] for fk in insp.get_foreign_keys("decisions")} == {"fk_decisions_plan_id_plans"}
    assert {ix["name"] for ix in insp.get_indexes("plans")} >= {
        "ix_plans_deployment_id_role_created_at", "ix_plans_entry_class_created_at", "ix_plans_created_at_plan_id"}


def test_is_at_head_never_raises():
    engine = make_engine("postgresql+psycopg://postgres@127.0.0.1:1/none?connect_timeout=3")
    assert is_at_head(engine) is False
    engine.dispose()
