"""SqlPlanStore through the Registry, on SQLite and PostgreSQL (DESIGN 6, 7)."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import json
import uuid

import pytest

from loadplan.plan import Decision, Keys, Parallel, Runtime
from loadplan.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from loadplan.service.registry import PlanFilter, Registry
from loadplan.service.store.db import make_engine
from loadplan.service.store.repository import SqlPlanStore

from store_helpers import DEEPSEEK_V3, QWEN3, Clock

UTC = dt.timezone.utc


# --- resolve: round trip, idempotency, pinning ------------------------------------------

def test_round_trip_rebuilds_the_whole_plan(registry, make_request):
    config = {**DEEPSEEK_V3, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
              "rope_scaling": {"type": "yarn", "factor": 40}}
    req = make_request(
        parallel=Parallel(tp_size=2, tp_rank=1, ep_size=4, ep_rank=3, pp_size=2, pp_rank=1, dp_size=2, dp_rank=1),
        host="gpu-node-17", config=config,
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
        runtime=Runtime(a2a_backend="none", device="cuda:9.0", engine="sglang", engine_version="0.5.23",
                        enable_tbo=True,
                        enable_eplb=True, ep_num_redundant_experts=32))
    plan = registry.resolve(req)
    assert not plan.replayed

    stored = registry.get_plan(plan.plan_id)
    assert stored == plan
    assert stored.request == req
    assert stored.created_at.tzinfo is UTC
    assert all(d.decided_at.tzinfo is UTC and d.revision == 0 for d in stored.decisions.values())
    # Values keep their JSON types (float vs int vs bool vs list).
    for key, d in plan.decisions.items():
        assert type(stored.decisions[key].value) is type(d.value), key

    with_history = registry.get_plan(plan.plan_id, include_history=True)
    assert sorted(with_history.history, key=lambda d: d.key) == sorted(plan.decisions.values(), key=lambda d: d.key)
    assert dataclasses.replace(with_history, history=()) == plan


def test_absent_quantization_config_stays_absent(registry, make_request):
    plan = registry.resolve(make_request(config=QWEN3, quantization_config=None, quantization=None))
    assert registry.get_plan(plan.plan_id).request.quantization_config is None
    plan = registry.resolve(make_request(deployment_id=f"{plan.request.deployment_id}-b", config=QWEN3,
                                         quantization_config={}))
    assert registry.get_plan(plan.plan_id).request.quantization_config == {}


def test_retry_returns_the_stored_plan_and_writes_nothing(registry, make_request, rows):
    req = make_request()
    first = registry.resolve(req)
    before = rows()
    again = registry.resolve(req)
    assert rows() == before
    assert again.replayed
    assert again.plan_id == first.plan_id
    assert dataclasses.replace(again, replayed=False) == first


def test_reused_request_id_for_another_request_is_refused(registry, make_request, rows):
    req = make_request()
    registry.resolve(req)
    before = rows()
    other = dataclasses.replace(req, parallel=Parallel(ep_size=2, ep_rank=1))
    with pytest.raises(FailedPrecondition, match=f"request_id '{req.request_id}' was used for a different request"):
        registry.resolve(other)
    assert rows() == before


@pytest.mark.parametrize("change, fields, values", [
    (dict(runtime=Runtime(a2a_backend="deepep")), ["runtime.a2a_backend"], ["'none'", "'deepep'"]),
    (dict(quantization_config={"quant_method": "fp8"}), ["quantization", "quantization_config_fingerprint"],
     ["None", "'fp8'"]),
    (dict(parallel=Parallel(tp_size=2, tp_rank=1)), ["parallel.tp_size"], ["1", "2"]),
])
def test_rank_with_other_deployment_wide_inputs_is_refused(registry, make_request, rows, change, fields, values):
    registry.resolve(make_request())   # the first rank pins the deployment
    before = rows()
    with pytest.raises(FailedPrecondition) as err:
        registry.resolve(make_request(**change))
    message = str(err.value)
    for f in fields:
        assert f in message
    for v in values:
        assert v in message
    assert err.value.field == fields[0]
    assert rows() == before
    # The refusal poisoned nothing: an agreeing rank still gets through.
    assert not registry.resolve(make_request(parallel=Parallel())).replayed


def test_roles_are_pinned_separately(registry, make_request):
    target = registry.resolve(make_request(role="target", runtime=Runtime(a2a_backend="deepep")))
    draft = registry.resolve(make_request(role="speculative", runtime=Runtime(a2a_backend="none")))
    assert target.value(Keys.FORWARD_PATH) != draft.value(Keys.FORWARD_PATH)


def test_ranks_share_deployment_wide_decisions(registry, make_request):
    plans = [registry.resolve(make_request(parallel=Parallel(ep_size=2, ep_rank=e, pp_size=2, pp_rank=p)))
             for e in range(2) for p in range(2)]
    wide = [{k: (d.value, d.reason, d.rule) for k, d in p.decisions.items() if d.deployment_wide} for p in plans]
    assert all(w == wide[0] for w in wide)
    assert {tuple(p.value(Keys.PP_LAYER_RANGE)) for p in plans} == {(0, 2), (2, 4)}


def test_failed_resolve_leaves_no_rows(registry, make_request, rows):
    before = rows()
    with pytest.raises(InvalidArgument):
        registry.resolve(make_request(config={"architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(NotFound):
        registry.resolve(make_request(runtime=Runtime(a2a_backend="no-such-backend")))
    assert rows() == before


def test_unknown_plan_is_not_found(registry):
    with pytest.raises(NotFound):
        registry.get_plan("no-such-plan")


# --- listing -------------------------------------------------------------------------------

@pytest.fixture
def t0() -> dt.datetime:
    return dt.datetime(2031, 5, 4, 12, 0, tzinfo=UTC)


@pytest.fixture
def clocked(store, t0) -> Registry:
    return Registry(store, clock=Clock(t0))


def _walk(registry, flt, page_size):
    seen, token, pages = [], None, 0
    while True:
        plans, token = registry.list_plans(flt, page_size, token)
        pages += 1
        seen += plans
        if not token:
            return seen, pages


def test_list_newest_first_with_filters_and_pages(clocked, make_request, deployment, t0):
    made = [clocked.resolve(make_request(parallel=Parallel(ep_size=8, ep_rank=i), host=deployment))
            for i in range(5)]
    drafts = [clocked.resolve(make_request(role="speculative", config=QWEN3,
                                           parallel=Parallel(ep_size=2, ep_rank=i), host=deployment))
              for i in range(2)]
    other = clocked.resolve(make_request(deployment_id=f"{deployment}-other", host=deployment))

    seen, pages = _walk(clocked, PlanFilter(deployment_id=deployment), page_size=2)
    assert [p.plan_id for p in seen] == [p.plan_id for p in reversed(made + drafts)]
    assert pages == 4
    assert seen[0] == drafts[-1]   # listed plans are whole plans

    seen, _ = _walk(clocked, PlanFilter(deployment_id=deployment, role="target"), page_size=3)
    assert [p.plan_id for p in seen] == [p.plan_id for p in reversed(made)]

    seen, _ = _walk(clocked, PlanFilter(host=deployment, entry_class="Qwen3MoeForCausalLM"), page_size=50)
    assert [p.plan_id for p in seen] == [p.plan_id for p in reversed(drafts)]

    seen, _ = _walk(clocked, PlanFilter(host=deployment), page_size=50)
    assert seen[0].plan_id == other.plan_id and len(seen) == 8

    # after inclusive, before exclusive; the plans were made one second apart from t0.
    window = PlanFilter(deployment_id=deployment, created_after=t0 + dt.timedelta(seconds=1),
                        created_before=t0 + dt.timedelta(seconds=3))
    seen, _ = _walk(clocked, window, page_size=1)
    assert [p.plan_id for p in seen] == [made[2].plan_id, made[1].plan_id]
    # Any aware time zone means the same instant.
    cet = dt.timezone(dt.timedelta(hours=2))
    seen, _ = _walk(clocked, dataclasses.replace(window, created_after=window.created_after.astimezone(cet)), 50)
    assert [p.plan_id for p in seen] == [made[2].plan_id, made[1].plan_id]


def test_pages_break_ties_on_plan_id(store, make_request, deployment, t0):
    same_time = Registry(store, clock=lambda: t0)
    made = [same_time.resolve(make_request(parallel=Parallel(ep_size=4, ep_rank=i))) for i in range(4)]
    seen, pages = _walk(same_time, PlanFilter(deployment_id=deployment), page_size=1)
    assert pages == 4
    assert [p.plan_id for p in seen] == sorted((p.plan_id for p in made), reverse=True)


def test_empty_list(registry):
    assert registry.list_plans(PlanFilter(deployment_id=f"nobody-{uuid.uuid4().hex}")) == ([], "")


@pytest.mark.parametrize("token", [
    "not a token!",
    base64.urlsafe_b64encode(b"not json").decode(),
    base64.urlsafe_b64encode(json.dumps({"p": "x"}).encode()).decode(),
    base64.urlsafe_b64encode(json.dumps({"t": "2031-01-01T00:00:00", "p": "x"}).encode()).decode(),  # naive
    base64.urlsafe_b64encode(json.dumps(["t", "p"]).encode()).decode(),
])
def test_malformed_page_token_is_invalid_argument(registry, token):
    with pytest.raises(InvalidArgument) as err:
        registry.list_plans(PlanFilter(), 10, token)
    assert err.value.field == "page_token"


def test_naive_time_filter_is_invalid_argument(registry):
    with pytest.raises(InvalidArgument) as err:
        registry.list_plans(PlanFilter(created_after=dt.datetime(2031, 1, 1)))
    assert err.value.field == "created_after"


# --- append_decisions ---------------------------------------------------------------------

def test_append_decisions_adds_revisions_idempotently(registry, make_request, rows):
    plan = registry.resolve(make_request(runtime=Runtime(enable_eplb=True)))
    layers_v0 = plan.decisions[Keys.EPLB_LAYERS]
    rebalance = [Decision(Keys.EPLB_LAYERS, [2, 3], "rebalanced: layer 1 is cold", "eplb.rebalance",
                          deployment_wide=False),
                 Decision(Keys.EPLB_PLACEMENT, [[0, 1], [1, 0]], "first placement", "eplb.rebalance")]

    after = registry.append_decisions("append-1", plan.plan_id, rebalance)
    assert not after.replayed
    assert after.decisions[Keys.EPLB_LAYERS].revision == layers_v0.revision + 1
    assert after.decisions[Keys.EPLB_LAYERS].value == [2, 3]
    assert after.decisions[Keys.EPLB_PLACEMENT].revision == 0   # a key new to the plan starts at 0
    assert after.decisions[Keys.EPLB_PLACEMENT].value == [[0, 1], [1, 0]]
    assert after.decisions[Keys.FORWARD_PATH] == plan.decisions[Keys.FORWARD_PATH]   # untouched keys stay

    before = rows()
    retried = registry.append_decisions("append-1", plan.plan_id, rebalance)
    assert retried.replayed and rows() == before
    assert retried.decisions == after.decisions

    with pytest.raises(FailedPrecondition, match="append-1"):
        registry.append_decisions("append-1", plan.plan_id, rebalance[:1])
    assert rows() == before

    latest = registry.append_decisions("append-2", plan.plan_id, rebalance[:1])
    assert latest.decisions[Keys.EPLB_LAYERS].revision == layers_v0.revision + 2

    full = registry.get_plan(plan.plan_id, include_history=True)
    assert full.decisions == latest.decisions
    layers = [d for d in full.history if d.key == Keys.EPLB_LAYERS]
    assert [d.revision for d in layers] == [0, 1, 2]
    assert [d.value for d in layers] == [layers_v0.value, [2, 3], [2, 3]]
    assert len(full.history) == len(plan.decisions) + 3


def test_append_to_unknown_plan_is_not_found(registry, rows):
    before = rows()
    with pytest.raises(NotFound):
        registry.append_decisions("append-x", "no-such-plan", [Decision("eplb.placement", [], "r", "rule")])
    assert rows() == before


# --- readiness and unavailability ---------------------------------------------------------

def test_ready_on_a_migrated_database(store):
    assert store.ready()


@pytest.fixture(params=["sqlite", "postgres"])
def unmigrated_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    return request.getfixturevalue("make_postgres_database")()


def test_unmigrated_database_is_not_ready(unmigrated_url, make_request):
    engine = make_engine(unmigrated_url)
    store = SqlPlanStore(engine)
    assert store.ready() is False
    with pytest.raises(Unavailable, match="not migrated.*loadplan migrate"):
        Registry(store).resolve(make_request())
    engine.dispose()


UNREACHABLE = {
    # Nothing listens on port 1; the connect fails at once.
    "postgres": "postgresql+psycopg://postgres@127.0.0.1:1/loadplan?connect_timeout=3",
    "sqlite": "sqlite:////nonexistent-dir-for-loadplan-tests/registry.db",
}


@pytest.mark.parametrize("kind", sorted(UNREACHABLE))
def test_unreachable_database_is_unavailable(kind, make_request):
    engine = make_engine(UNREACHABLE[kind])
    store = SqlPlanStore(engine)
    registry = Registry(store)
    assert store.ready() is False
    with pytest.raises(Unavailable, match="retry"):
        registry.resolve(make_request())
    with pytest.raises(Unavailable):
        registry.get_plan("some-plan")
    with pytest.raises(Unavailable):
        registry.list_plans(PlanFilter())
    with pytest.raises(Unavailable):
        registry.append_decisions("a", "some-plan", [Decision("k", 1, "r", "rule")])
    engine.dispose()


def test_times_come_back_in_utc_whatever_the_session_time_zone(postgres_url, make_request):
    # PostgreSQL answers TIMESTAMPTZ in the session's zone; the store hands back UTC.
    engine = make_engine(postgres_url, connect_args={"options": "-c timezone=Asia/Tokyo"})
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW timezone").scalar() == "Asia/Tokyo"
    registry = Registry(SqlPlanStore(engine))
    plan = registry.resolve(make_request())
    stored = registry.get_plan(plan.plan_id)
    assert stored == plan
    assert stored.created_at.tzinfo is UTC
    assert {d.decided_at.tzinfo for d in stored.decisions.values()} == {UTC}
    engine.dispose()
