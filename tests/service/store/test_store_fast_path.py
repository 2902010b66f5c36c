"""PostgreSQL's optimistic path (`SqlPlanStore._pg_fast`): one autocommitted statement per batch.

What a save sends is observed on the engine (SQLAlchemy's cursor events), not assumed, and the
autocommit mode the path borrows must not leak into the pool's later transactions.
"""

from __future__ import annotations

import dataclasses
import json
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


_IDENTITY = ("plan_id", "request_id", "request_fingerprint", "deployment_id", "created_at")


def _stored_rows(engine, deployment_ids) -> dict[str, dict]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT * FROM plans WHERE deployment_id = ANY(:d)"),
                            {"d": list(deployment_ids)}).mappings().all()
    return {r["deployment_id"]: {k: v for k, v in r.items() if k not in _IDENTITY} for r in rows}


def test_a_plan_written_alone_is_stored_as_one_written_in_a_batch(engine, make_request, deployment):
    """A batch of one plan has statements of its own (plain parameters, no JSON document): the
    row they store must be the one the batch statements store for the same request."""
    store = SqlPlanStore(engine)
    registry = Registry(store)
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    like = dict(parallel=Parallel(ep_size=2, ep_rank=1), host="node-\u00e9", quantization_config=qc)
    news = [registry.new_plan(make_request(deployment_id=f"{deployment}-{x}", **like)) for x in "abc"]
    sent = _statements(engine)
    assert not store.save_plan(news[0]).replayed                  # alone: a batch of one
    outcomes = store._save_batch(news[1:])                         # together: one JSON statement
    assert [o.plan_id for o in outcomes] == [n.plan.plan_id for n in news[1:]]
    assert sent == ["WITH new_pins AS (INSERT", "WITH texts AS MATERIALIZED"], sent   # alone, then the batch
    rows = _stored_rows(engine, [n.plan.request.deployment_id for n in news])
    assert len(rows) == 3
    alone, *batched = rows.values()
    assert all(row == alone for row in batched), (alone, batched)
    # and a rank of a known pin, alone, by the plain single-row INSERT
    rank = registry.new_plan(make_request(deployment_id=f"{deployment}-a", request_id=f"req-{uuid.uuid4().hex}",
                                          **{**like, "parallel": Parallel(ep_size=2, ep_rank=0)}))
    sent.clear()
    assert store.save_plan(rank).plan_id == rank.plan.plan_id
    assert sent == ["INSERT INTO plans (plan_id,"], sent


def test_a_plan_is_stored_alike_with_or_without_its_unstamped_decisions(engine, make_request, deployment):
    """`NewPlan.unstamped` lets the store encode the decisions the rules share once for every plan
    carrying them: the row must be the one encoded from the plan's own stamped decisions, alone
    and in a batch."""
    store = SqlPlanStore(engine)
    registry = Registry(store)
    news = [registry.new_plan(make_request(deployment_id=f"{deployment}-{x}", parallel=Parallel(ep_size=2)))
            for x in "abcdef"]
    assert all(n.unstamped is not None for n in news)
    plain = [dataclasses.replace(n, unstamped=None) for n in news[3:]]
    assert not store.save_plan(news[0]).replayed and not store.save_plan(plain[0]).replayed   # alone
    batched = news[1:3] + plain[1:]
    outcomes = store._save_batch(news[1:3]) + store._save_batch(plain[1:])                   # in batches
    assert [o.plan_id for o in outcomes] == [n.plan.plan_id for n in batched]
    rows = _stored_rows(engine, [n.plan.request.deployment_id for n in news])
    assert len(rows) == 6
    first, *others = rows.values()
    assert all(row == first for row in others), (first, others)
    assert json.loads(first["decisions_json"]) == [[d.key, d.value, d.reason, d.rule, d.deployment_wide]
                                                   for d in news[0].plan.decisions.values()]


@pytest.mark.parametrize("together", [False, True], ids=["alone", "in a batch"])
def test_an_over_long_value_is_refused_not_truncated(engine, make_request, deployment, together):
    store = SqlPlanStore(engine)
    registry = Registry(store)
    # plans.host is VARCHAR(255); the rules refuse longer ones before, so the plan is altered after
    valid = registry.new_plan(make_request())
    request = dataclasses.replace(valid.plan.request, host="h" * 300)
    bad = dataclasses.replace(valid, plan=dataclasses.replace(valid.plan, request=request))
    if together:
        good = registry.new_plan(make_request(deployment_id=f"{deployment}-ok"))
        outcomes = store._save_batch([bad, good])
        assert outcomes[1].plan_id == good.plan.plan_id            # the other plan is not failed with it
        refusal = outcomes[0]
        assert isinstance(refusal, Exception)
    else:
        with pytest.raises(Exception) as info:
            store.save_plan(bad)
        refusal = info.value
    assert "too long" in str(refusal)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM plans WHERE deployment_id = :d"),
                            {"d": deployment}).scalar_one() == 0


def test_plans_made_like_another_are_stored_as_plans_made_from_scratch(engine, make_request, deployment):
    """`NewPlan.like` lets the batch statement reuse the JSON row of the plan a plan was made like
    (`_PlanRowTemplate`): what is stored must be what the same requests made from scratch store,
    their own ids, fingerprints and times included."""
    store = SqlPlanStore(engine)
    registry = Registry(store)
    like = dict(parallel=Parallel(ep_size=2, ep_rank=1), host="node-\u00e9",
                quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    first = registry.new_plan(make_request(deployment_id=f"{deployment}-first", **like))
    made_like = [registry.new_plan_like(first, f"req-{uuid.uuid4().hex}", f"{deployment}-like-{x}") for x in "ab"]
    scratch = [registry.new_plan(dataclasses.replace(n.plan.request, deployment_id=f"{deployment}-new-{x}",
                                                     request_id=f"req-{uuid.uuid4().hex}")) for x, n in
               zip("ab", made_like)]
    assert all(n.like is first for n in made_like) and all(n.like is None for n in scratch)
    outcomes = store._save_batch([first, *made_like]) + store._save_batch(scratch)
    assert [o.plan_id for o in outcomes] == [n.plan.plan_id for n in (first, *made_like, *scratch)]
    with engine.connect() as conn:
        rows = {r["plan_id"]: dict(r) for r in conn.execute(
            sa.text("SELECT * FROM plans WHERE deployment_id LIKE :d"), {"d": f"{deployment}-%"}).mappings()}
    for n in (*made_like, *scratch):
        row = rows[n.plan.plan_id]
        plan, req = n.plan, n.plan.request
        assert (row["request_id"], row["deployment_id"], row["request_fingerprint"], row["created_at"]) == \
            (req.request_id, req.deployment_id, n.request_fingerprint, plan.created_at)
    strip = lambda row: {k: v for k, v in row.items() if k not in _IDENTITY}   # noqa: E731
    assert all(strip(row) == strip(rows[first.plan.plan_id]) for row in rows.values())
    assert store.get_plan(made_like[0].plan.plan_id) == dataclasses.replace(made_like[0].plan,
                                                                           decisions=dict(made_like[0].plan.decisions))
