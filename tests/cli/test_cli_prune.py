"""`loadplan prune`: the retention job on a history database (SQLite here; the pruning itself is tested on both
databases in tests/service/store/test_retention.py). Plans are backdated with the registry's clock."""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid

import pytest

from cli_helpers import run
from loadplan.plan import Parallel, ResolveRequest, Runtime
from loadplan.service.registry import Registry
from loadplan.service.store.db import make_engine, migrate
from loadplan.service.store.repository import SqlPlanStore

NOW = dt.datetime.now(dt.timezone.utc)
CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2, "num_experts": 8,
          "num_experts_per_tok": 2}


@pytest.fixture
def db(tmp_path):
    """A history with, 40 days ago, two ranks of one deployment (rank 0 pinned), and one plan of today."""
    url = f"sqlite:///{tmp_path / 'history.db'}"
    migrate(url)
    engine = make_engine(url)
    when = {"now": NOW - dt.timedelta(days=40)}
    registry = Registry(SqlPlanStore(engine), clock=lambda: when["now"])
    for deployment, rank, age in (("old", 0, 40), ("old", 1, 40), ("new", 0, 0)):
        when["now"] = NOW - dt.timedelta(days=age)
        registry.resolve(ResolveRequest(request_id=uuid.uuid4().hex, deployment_id=deployment, role="target",
                                        parallel=Parallel(ep_size=2, ep_rank=rank), host="h", config=CONFIG,
                                        quantization_config=None, quantization=None, runtime=Runtime()))
    engine.dispose()
    return url


def _plan_count(url) -> int:
    import sqlalchemy as sa

    engine = make_engine(url)
    with engine.connect() as conn:
        n = conn.execute(sa.text("SELECT count(*) FROM plans")).scalar_one()
    engine.dispose()
    return n


def test_dry_run_then_prune_older_than_30_days(db, capsys):
    code, out, err = run(capsys, "prune", "--db", db, "--older-than", "30d", "--dry-run")
    assert code == 0, err
    assert out.startswith("would prune 1 of the 2 plans created before ")
    assert "(kept: 1 pinned by their deployment, 0 with decisions since)" in out
    assert _plan_count(db) == 3

    asked = dt.datetime.now(dt.timezone.utc)
    code, out, err = run(capsys, "prune", "--db", db, "--older-than", "30d", "--json")
    answered = dt.datetime.now(dt.timezone.utc)
    assert code == 0, err
    doc = json.loads(out)
    assert {k: doc[k] for k in ("dry_run", "older", "kept_pinned", "kept_active", "pruned", "batches")} == {
        "dry_run": False, "older": 2, "kept_pinned": 1, "kept_active": 0, "pruned": 1, "batches": 1}
    cutoff = dt.datetime.fromisoformat(doc["before"].replace("Z", "+00:00"))
    # 30 days before the prune ran (not before this module was imported: a loaded suite may run it minutes later)
    assert asked - dt.timedelta(days=30) <= cutoff <= answered - dt.timedelta(days=30)
    assert _plan_count(db) == 2


def test_a_cutoff_by_time(db, capsys):
    before = (NOW - dt.timedelta(days=39)).replace(tzinfo=None).isoformat()     # naive: UTC
    code, out, err = run(capsys, "prune", "--db", db, "--before", before, "--json")
    assert code == 0, err
    assert json.loads(out)["pruned"] == 1


@pytest.mark.parametrize("args, message", [
    (("--older-than", "30 days"), "--older-than: '30 days' is not a duration"),
    (("--older-than", "10m"), "--older-than: the cutoff .* is less than 1:00:00 ago"),
    (("--before", "yesterday"), "--before: 'yesterday' is not an ISO 8601 time"),
    (("--before", (NOW + dt.timedelta(days=1)).isoformat()), "--before: the cutoff .* is less than 1:00:00 ago"),
    (("--older-than", "30d", "--batch-size", "0"), "--batch-size: must be >= 1, got 0"),
    ((), "one of the arguments --older-than --before is required"),
    (("--older-than", "30d", "--before", "2026-01-01"), "not allowed with argument"),
])
def test_bad_arguments_are_refused_by_flag_and_nothing_is_deleted(db, capsys, args, message):
    code, out, err = run(capsys, "prune", "--db", db, *args)
    assert code == 2 and out == ""
    assert err.startswith("error: INVALID_ARGUMENT: ")
    assert re.search(message, err), err
    assert _plan_count(db) == 3


def test_an_unreachable_database_is_unavailable(capsys):
    code, _, err = run(capsys, "prune", "--db", "postgresql+psycopg://nobody@127.0.0.1:1/none", "--older-than", "30d")
    assert code == 1
    assert err.startswith("error: UNAVAILABLE: database postgresql+psycopg://nobody@127.0.0.1:1/none: ")
