"""Migration 0003: the long texts of plans and pins are compressed with lz4 on PostgreSQL.

Checked on what the store writes (the compression PostgreSQL reports for a stored
value), and that a plan reads back the same whichever compression holds it."""

from __future__ import annotations

import dataclasses
import importlib

import sqlalchemy as sa

from loadplan.plan import Parallel, ResolveRequest, Runtime
from loadplan.service.registry import Registry
from loadplan.service.store.db import downgrade, make_engine, migrate
from loadplan.service.store.repository import SqlPlanStore

migration = importlib.import_module("loadplan.migrations.versions.0003_lz4_long_texts")

# A config as long as real ones (a DeepSeek-V3 config.json is about 1.7 KB): the plan row is
# over PostgreSQL's 2 KB threshold, so its long texts are compressed.
CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, "n_routed_experts": 16,
          "n_shared_experts": 1, "num_experts_per_tok": 4, "first_k_dense_replace": 1,
          **{f"extra_setting_{i}": f"value number {i} of a long config" for i in range(40)}}


def _compression(engine, table: str, column: str, where: str) -> str | None:
    with engine.connect() as conn:
        return conn.execute(sa.text(f"SELECT pg_column_compression({column}) FROM {table} WHERE {where}")).scalar()


def _resolve(engine, request_id: str, deployment: str):
    registry = Registry(SqlPlanStore(engine))
    return registry.resolve(ResolveRequest(request_id, deployment, parallel=Parallel(ep_size=2),
                                           config=CONFIG, runtime=Runtime(enable_eplb=True)))


def test_plans_and_pins_are_written_with_lz4_and_read_back_alike(make_postgres_database):
    url = make_postgres_database()
    migrate(url, "0002")
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            assert migration.lz4_available(conn), "the test database's PostgreSQL has no lz4"
        before = _resolve(engine, "r-before", "d-before")
        migrate(url)
        after = _resolve(engine, "r-after", "d-after")
        where = "plan_id = '{}'"
        assert _compression(engine, "plans", "decisions_json", where.format(before.plan_id)) == "pglz"
        assert _compression(engine, "plans", "decisions_json", where.format(after.plan_id)) == "lz4"
        assert _compression(engine, "plans", "config_json", where.format(after.plan_id)) == "lz4"
        store = SqlPlanStore(engine)
        for plan in (before, after):
            assert store.get_plan(plan.plan_id) == dataclasses.replace(plan, history=())
        # Downgrade: new values get the server's default again; stored ones read as they were.
        downgrade(url, "0002")
        again = _resolve(engine, "r-again", "d-again")
        assert _compression(engine, "plans", "decisions_json", where.format(again.plan_id)) == "pglz"
        assert store.get_plan(after.plan_id) == dataclasses.replace(after, history=())
    finally:
        engine.dispose()


def test_without_lz4_the_revision_changes_nothing(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    migrate(url)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            assert not migration.lz4_available(conn)
        assert _resolve(engine, "r1", "d1").plan_id
    finally:
        engine.dispose()
