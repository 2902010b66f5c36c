"""Registry.diff_plans: the decisions that differ between two plans, and the inputs
that explain them (e.g. a target and its draft, or two ranks of one deployment)."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from loadplan.plan import Keys, LoadPlan, Parallel, ResolveRequest, Runtime
from loadplan.errors import InvalidArgument, NotFound
from loadplan.service.registry import Registry, diff_plans

TARGET = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, "n_routed_experts": 256,
          "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1}
DRAFT = {**TARGET, "architectures": ["DeepseekV3ForCausalLMNextN"], "num_nextn_predict_layers": 1}


class FakeStore:
    """Keeps plans in a dict; enough of PlanStore for resolve and diff."""

    def __init__(self):
        self.plans: dict[str, LoadPlan] = {}

    def save_plan(self, new):
        self.plans[new.plan.plan_id] = new.plan
        return new.plan

    def get_plan(self, plan_id, include_history=False):
        try:
            return self.plans[plan_id]
        except KeyError:
            raise NotFound("plan", plan_id) from None


@pytest.fixture
def registry():
    return Registry(FakeStore(), clock=lambda: dt.datetime(2026, 11, 29, tzinfo=dt.timezone.utc))


def req(request_id, config=TARGET, role="target", quantization=None, parallel=Parallel(), runtime=Runtime(),
        host="node0"):
    return ResolveRequest(request_id=request_id, deployment_id="dep-1", role=role, parallel=parallel, host=host,
                          config=config, quantization=quantization, runtime=runtime)


def test_a_plan_against_itself_has_no_difference(registry):
    a = registry.resolve(req("r1"))
    d = registry.diff_plans(a.plan_id, a.plan_id)
    assert d.decisions == [] and d.inputs == []
    assert d.a.plan_id == d.b.plan_id == a.plan_id


def test_target_against_a_draft_quantized_differently(registry):
    target = registry.resolve(req("r1", quantization="fp8"))
    draft = registry.resolve(req("r2", DRAFT, role="speculative", quantization="w4afp8"))
    d = registry.diff_plans(target.plan_id, draft.plan_id)
    keys = {k for k, _, _ in d.decisions}
    assert Keys.SHARED_EXPERTS_FUSION in keys and Keys.NUM_FUSED_SHARED_EXPERTS in keys
    assert Keys.PP_LAYER_RANGE in keys  # the draft's layer is numbered after the target's
    assert Keys.FORWARD_PATH not in keys  # same value on both sides is not a difference
    fusion = next((a, b) for k, a, b in d.decisions if k == Keys.SHARED_EXPERTS_FUSION)
    assert fusion[0].value is True and fusion[1].value is False
    assert fusion[1].rule == "deepseek.quantization"
    fields = {f: (a, b) for f, a, b in d.inputs}
    assert fields["role"] == ("target", "speculative")
    assert fields["entry_class"] == ("DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMNextN")
    assert fields["quantization"] == ("fp8", "w4afp8")
    assert "config_fingerprint" in fields
    assert "deployment_id" not in fields and "host" not in fields


def test_two_ranks_differ_only_in_rank_specific_decisions(registry):
    a = registry.resolve(req("r1", parallel=Parallel(pp_size=2, pp_rank=0, ep_size=2, ep_rank=0),
                             runtime=Runtime(enable_eplb=True)))
    b = registry.resolve(req("r2", parallel=Parallel(pp_size=2, pp_rank=1, ep_size=2, ep_rank=1),
                             runtime=Runtime(enable_eplb=True), host="node1"))
    d = diff_plans(a, b)
    assert {k for k, _, _ in d.decisions} == {Keys.PP_LAYER_RANGE, Keys.EPLB_LAYERS}
    assert all(not da.deployment_wide for _, da, _ in d.decisions)
    assert [f for f, _, _ in d.inputs] == ["host", "parallel.ep_rank", "parallel.pp_rank"]


def test_runtime_inputs_are_named(registry):
    a = registry.resolve(req("r1"))
    b = registry.resolve(req("r2", runtime=Runtime(a2a_backend="mori"), parallel=Parallel(ep_size=2)))
    d = registry.diff_plans(a.plan_id, b.plan_id)
    assert [f for f, _, _ in d.inputs] == ["parallel.ep_size", "runtime.a2a_backend"]
    assert ("runtime.a2a_backend", "none", "mori") in d.inputs
    keys = {k for k, _, _ in d.decisions}
    assert {Keys.FORWARD_PATH, Keys.SHARED_EXPERTS_FUSION, Keys.NUM_LOCAL_EXPERTS} <= keys


def test_a_decision_on_one_side_only_is_a_difference(registry):
    a = registry.resolve(req("r1"))
    trimmed = {k: v for k, v in a.decisions.items() if k != Keys.EPLB_LAYERS}
    b = dataclasses.replace(a, plan_id="other", decisions=trimmed)
    d = diff_plans(a, b)
    assert [(k, da is not None, db is not None) for k, da, db in d.decisions] == [(Keys.EPLB_LAYERS, True, False)]
    assert diff_plans(b, a).decisions[0][1:] == (None, a.decisions[Keys.EPLB_LAYERS])


def test_same_value_with_another_reason_is_not_a_difference(registry):
    a = registry.resolve(req("r1"))
    key = Keys.FORWARD_PATH
    b = dataclasses.replace(a, plan_id="other",
                            decisions={**a.decisions, key: dataclasses.replace(a.decisions[key], reason="other")})
    assert diff_plans(a, b).decisions == []


@pytest.mark.parametrize("a_id,b_id,field", [("", "x", "plan_a"), ("x", "", "plan_b")])
def test_plan_ids_are_required(registry, a_id, b_id, field):
    with pytest.raises(InvalidArgument) as e:
        registry.diff_plans(a_id, b_id)
    assert e.value.field == field


def test_unknown_plan_is_not_found(registry):
    a = registry.resolve(req("r1"))
    with pytest.raises(NotFound):
        registry.diff_plans(a.plan_id, "nope")
