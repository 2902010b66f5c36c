"""No token in the history database: every column of every table, after authenticated and refused calls."""

from __future__ import annotations

import hashlib
import uuid

import pytest
import sqlalchemy as sa
from sample_requests import request

from loadplan.client import RegistryCallError, RegistryClient
from loadplan.plan import Decision, Parallel
from loadplan.service.store.repository import SqlPlanStore


def dump(engine) -> str:
    """Every value of every row of every table, as text."""
    parts = []
    with engine.connect() as conn:
        for table in sa.inspect(conn).get_table_names():
            for row in conn.execute(sa.text(f'SELECT * FROM "{table}"')):
                parts.extend(f"{table}: {value!s}" for value in row)
    return "\n".join(parts)


def test_tokens_are_not_written_to_the_history(db_engine, start_server, token_store, tokens):
    server = start_server(SqlPlanStore(db_engine), tokens=token_store)
    deployment = f"dep-sec-{uuid.uuid4().hex[:8]}"
    with RegistryClient(server.address, timeout=10.0, token=tokens["worker"]) as worker:
        plans = [worker.resolve_load_plan(request(deployment_id=deployment, parallel=Parallel(tp_size=2, tp_rank=r)))
                 for r in range(2)]
        worker.append_decisions(uuid.uuid4().hex, plans[0].plan_id,
                                [Decision("eplb.rebalanced", True, "rebalance after warm-up", "test")])
    with RegistryClient(server.address, timeout=10.0, max_attempts=1, token=tokens["reader"]) as reader:
        with pytest.raises(RegistryCallError, match="PERMISSION_DENIED"):
            reader.resolve_load_plan(request(deployment_id=deployment + "-denied"))
    with RegistryClient(server.address, timeout=10.0, token=tokens["admin"]) as admin:
        assert {p.plan_id for p in admin.iter_plans(deployment_id=deployment)} == {p.plan_id for p in plans}
        assert admin.list_plans(deployment_id=deployment + "-denied")[0] == []

    text = dump(db_engine)
    assert deployment in text and "rebalance after warm-up" in text      # the dump does see the rows
    for token in tokens.values():
        assert token not in text
        assert hashlib.sha256(token.encode()).hexdigest() not in text
