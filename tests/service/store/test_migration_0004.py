"""Migration 0004: indexes on the foreign keys to plans from deployment_pins and decision_appends (what deleting a
plan checks), on both databases; downgrade drops them. That the database uses them is shown by what it plans."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from loadplan.service.store.db import downgrade, make_engine, migrate

INDEXES = {"deployment_pins": "ix_deployment_pins_plan_id", "decision_appends": "ix_decision_appends_plan_id"}


def _plan_id_indexes(engine) -> dict[str, list[str]]:
    inspector = sa.inspect(engine)
    return {table: [ix["name"] for ix in inspector.get_indexes(table) if ix["column_names"] == ["plan_id"]]
            for table in INDEXES}


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'history.db'}"
    return request.getfixturevalue("make_postgres_database")()


def test_upgrade_adds_the_plan_id_indexes_and_downgrade_drops_them(url):
    migrate(url, "0003")
    engine = make_engine(url)
    try:
        assert _plan_id_indexes(engine) == {t: [] for t in INDEXES}
        migrate(url)
        assert _plan_id_indexes(engine) == {t: [name] for t, name in INDEXES.items()}
        with engine.connect() as conn:
            if conn.dialect.name == "sqlite":
                query = "EXPLAIN QUERY PLAN SELECT 1 FROM deployment_pins WHERE plan_id = 'p'"
                plan = conn.exec_driver_sql(query).all()
                assert any("ix_deployment_pins_plan_id" in str(row) for row in plan), plan
        downgrade(url, "0003")
        assert _plan_id_indexes(engine) == {t: [] for t in INDEXES}
    finally:
        engine.dispose()
