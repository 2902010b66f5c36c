"""Migration 0002 (plans.decisions_json): plans written on either side of it read back whole.

A plan written under 0001 keeps its revision-0 decision rows; one written under 0002
carries them in its row; a downgrade turns the column back into rows. Each is checked
through the store (decisions, history, the next revision of an append), not by counting.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid

import pytest
import sqlalchemy as sa

from loadplan.plan import Decision, Keys
from loadplan.service.registry import Registry
from loadplan.service.store.db import downgrade, make_engine, migrate
from loadplan.service.store.repository import SqlPlanStore

UTC = dt.timezone.utc


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}"
    return request.getfixturevalue("make_postgres_database")()


def _write_0001_plan(engine, plan_id: str, created: dt.datetime, decisions: dict[str, object]) -> None:
    """A plan as the 0001 store wrote it: the row, and one decision row per key (revision 0)."""
    meta = sa.MetaData()
    plans = sa.Table("plans", meta, autoload_with=engine)
    rows = sa.Table("decisions", meta, autoload_with=engine)
    assert "decisions_json" not in plans.c
    at = created if engine.dialect.name != "sqlite" else created.replace(tzinfo=None)
    with engine.begin() as conn:
        conn.execute(sa.insert(plans).values(
            plan_id=plan_id, request_id=f"r-{plan_id}", request_fingerprint="f" * 64, deployment_id="d-old",
            role="target", host="h", tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, pp_size=1, pp_rank=0,
            dp_size=1, dp_rank=0, entry_class="DeepseekV3ForCausalLM", config_fingerprint="c" * 64,
            config_json=json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}), quantization=None,
            requested_quantization=None, quantization_config_json=None, runtime_json="{}",
            ruleset_version="old", created_at=at))
        conn.execute(sa.insert(rows), [
            dict(plan_id=plan_id, key=k, revision=0, value_json=json.dumps(v), reason=f"why {k}", rule="r",
                 deployment_wide=True, decided_at=at) for k, v in decisions.items()])


def test_a_plan_written_before_0002_reads_back_and_takes_appends(empty_url):
    migrate(empty_url, "0001")
    engine = make_engine(empty_url)
    created = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    old = {Keys.EPLB_LAYERS: [3, 4], "moe.forward_path": "normal"}
    try:
        _write_0001_plan(engine, "p-old", created, old)
        migrate(empty_url)
        registry = Registry(SqlPlanStore(engine))
        plan = registry.get_plan("p-old")
        assert {k: d.value for k, d in plan.decisions.items()} == old
        assert all(d.revision == 0 and d.decided_at == created for d in plan.decisions.values())

        after = registry.append_decisions("append-old", "p-old", [Decision(Keys.EPLB_LAYERS, [5], "rebalanced", "r")])
        assert after.decisions[Keys.EPLB_LAYERS].value == [5]
        assert after.decisions[Keys.EPLB_LAYERS].revision == 1
        history = registry.get_plan("p-old", include_history=True).history
        assert sorted((d.key, d.revision) for d in history) == [
            (Keys.EPLB_LAYERS, 0), (Keys.EPLB_LAYERS, 1), ("moe.forward_path", 0)]
    finally:
        engine.dispose()


def test_downgrade_turns_a_plans_decisions_back_into_rows(empty_url, make_request):
    migrate(empty_url)
    engine = make_engine(empty_url)
    try:
        registry = Registry(SqlPlanStore(engine))
        plan = registry.resolve(make_request(deployment_id=f"d-{uuid.uuid4().hex[:6]}"))
        appended = registry.append_decisions("a-1", plan.plan_id, [Decision(Keys.EPLB_LAYERS, [9], "moved", "r")])
        with engine.connect() as conn:   # one row of its own: only the append
            assert conn.execute(sa.text("SELECT count(*) FROM decisions")).scalar_one() == 1
        engine.dispose()

        downgrade(empty_url, "0001")
        with engine.connect() as conn:
            cols = {c["name"] for c in sa.inspect(conn).get_columns("plans")}
            stored = conn.execute(sa.text("SELECT key, revision FROM decisions WHERE plan_id = :p"),
                                  {"p": plan.plan_id}).all()
        assert "decisions_json" not in cols
        assert sorted(stored) == sorted([(k, 0) for k in plan.decisions] + [(Keys.EPLB_LAYERS, 1)])
        engine.dispose()

        migrate(empty_url)   # up again: the plan is read from its rows now, the same as before
        again = Registry(SqlPlanStore(engine)).get_plan(plan.plan_id, include_history=True)
        assert {k: (d.value, d.revision) for k, d in again.decisions.items()} == \
            {k: (d.value, d.revision) for k, d in appended.decisions.items()}
        assert all(d.decided_at == plan.created_at for d in again.history if d.revision == 0)
    finally:
        engine.dispose()
