"""The plan is readable while building and refused during forward."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.loader import load_model
from loadplan.engine.plan_guard import GuardedPlan, PlanReadDuringForward
from loadplan.plan import Keys

from engine_helpers import LocalRegistry, make_checkpoint, make_plan, prompt, qwen2_config


def test_reads_work_outside_forward_and_raise_inside():
    plan = make_plan(qwen2_config())
    assert isinstance(plan, GuardedPlan)
    assert plan.decisions[Keys.SHARED_EXPERTS_FUSION].value is True
    with plan.forward_running():
        with pytest.raises(PlanReadDuringForward, match="moe.shared_experts_fusion"):
            plan.decisions[Keys.SHARED_EXPERTS_FUSION]
        with pytest.raises(PlanReadDuringForward):
            plan.value(Keys.FORWARD_PATH)
        with pytest.raises(PlanReadDuringForward):
            list(plan.decisions)
        assert plan.plan_id and plan.entry_class == "Qwen2MoeForCausalLM"   # not decision state
    assert plan.value(Keys.FORWARD_PATH) == "normal"


def test_unknown_key_lists_the_known_ones():
    plan = make_plan(qwen2_config())
    with pytest.raises(KeyError, match="moe.forward_path"):
        plan.decisions["moe.no_such_key"]


def test_a_layer_reading_the_plan_during_forward_fails(tmp_path):
    path = make_checkpoint(tmp_path, "Qwen2MoeForCausalLM", num_hidden_layers=2)
    model = load_model(path, registry=LocalRegistry())
    ids = prompt(B=1, T=3)
    with torch.no_grad():
        model(ids)   # the engine's own layers read nothing during forward

    block = model.model.layers[1].mlp
    original = block.forward

    def bad_forward(x):   # what the mori double-reduction bug looked like: a decision read per call
        if model.plan.decisions[Keys.POST_EXPERTS_ALL_REDUCE].value:
            pass
        return original(x)

    block.forward = bad_forward
    with pytest.raises(PlanReadDuringForward, match="moe.post_experts_all_reduce"):
        with torch.no_grad():
            model(ids)
    # and after the forward the plan is readable again
    assert model.plan.decisions[Keys.POST_EXPERTS_ALL_REDUCE].value is False
