"""PostgreSQL's optimistic path (`SqlPlanStore._pg_fast`): one autocommitted statement per batch.

What a save sends is observed on the engine (SQLAlchemy's cursor events), not assumed, and the
autocommit mode the path borrows must not leak into the pool's later transactions.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from loadplan.plan import Parallel
from loadplan.service.registry import Registry
from loadplan.service.store.db import make_engine
from loadplan.service.store.repository import SqlPlanStore


@pytest.fixture
def engine(postgres_url):
    # One connection: every save and transaction below goes through the same one.
    eng = make_engine(postgres_url, pool_size=1, max_overflow=0)
    yield eng
    eng.dispose()


def _statements(engine) -> list[str]:
    sent: list[str] = []
    event.listen(engine, "before_cursor_execute",
                 lambda conn, cursor, statement, *rest: sent.append(" ".join(statement.split()[:4])))
    return sent


def test_a_save_is_one_statement_and_commits_without_a_transaction(engine, make_request):
    registry = Registry(SqlPlanStore(engine))
    sent = _statements(engine)
    first = registry.resolve(make_request(parallel=Parallel(ep_size=2, ep_rank=0)))   # pins the deployment
    assert sent == ["WITH new_pins AS (INSERT"], sent
    sent.clear()
    second = registry.resolve(make_request(parallel=Parallel(ep_size=2, ep_rank=1)))  # a rank of a known pin
    assert sent == ["INSERT INTO plans (plan_id,"], sent

    # Committed by the statement itself: another connection sees both plans and the one pin.
    other = make_engine(engine.url)
    try:
        with other.connect() as conn:
            plans = conn.execute(sa.text("SELECT count(*) FROM plans WHERE plan_id IN (:a, :b)"),
                                 {"a": first.plan_id, "b": second.plan_id}).scalar_one()
            pin = conn.execute(sa.text("SELECT plan_id FROM deployment_pins WHERE deployment_id = :d"),
                               {"d": first.request.deployment_id}).scalar_one()
    finally:
        other.dispose()
    assert plans == 2 and pin == first.plan_id


def test_the_pooled_connection_is_transactional_again_after_a_save(engine, make_request, deployment):
    store = SqlPlanStore(engine)
    Registry(store).resolve(make_request())
    marker = f"{deployment}-rolled-back"
    with store.unit_of_work(write=True) as uow:   # the same (only) connection the save used
        assert uow.conn.connection.dbapi_connection.autocommit is False
        uow.conn.execute(sa.text("INSERT INTO decision_appends (request_id, plan_id, request_fingerprint, "
                                 "created_at) SELECT :r, plan_id, 'f', now() FROM plans LIMIT 1"), {"r": marker})
        # not committed: rolled back on exit
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM decision_appends WHERE request_id = :r"),
                            {"r": marker}).scalar_one() == 0


def test_a_pin_set_elsewhere_sends_the_plan_the_careful_way(postgres_url, make_request, deployment):
    """Replica B's cache does not know the pin A set: its statement leaves the plan out (nothing
    written), and the careful way then checks the stored pin and writes it."""
    a, b = make_engine(postgres_url), make_engine(postgres_url)
    try:
        Registry(SqlPlanStore(a)).resolve(make_request(parallel=Parallel(ep_size=2, ep_rank=0)))
        sent = _statements(b)
        plan = Registry(SqlPlanStore(b)).resolve(make_request(parallel=Parallel(ep_size=2, ep_rank=1),
                                                              request_id=f"req-{uuid.uuid4().hex}"))
        assert sent[0] == "WITH new_pins AS (INSERT", sent            # tried as the pin's setter...
        assert any(s.startswith("SELECT") for s in sent[1:]), sent    # ...then looked the pin up
        assert not plan.replayed
        with a.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM plans WHERE deployment_id = :d"),
                                {"d": deployment}).scalar_one() == 2
    finally:
        a.dispose()
        b.dispose()
