import pytest

from loadplan.integrations.vllm.agreement import PlanRefused, check_agreement, disagreements
from loadplan.integrations.vllm.built import Built
from loadplan.plan import Decision, Keys, LoadPlan, ResolveRequest


def plan(**values) -> LoadPlan:
    return LoadPlan(plan_id="p1", ruleset_version="r", request=ResolveRequest("r1", "prod"), entry_class="X",
                    config_fingerprint="f", quantization=None,
                    decisions={k: Decision(k, v, f"because {k}", "rule") for k, v in values.items()})


def test_agreeing_plan_passes():
    p = plan(**{Keys.POST_EXPERTS_ALL_REDUCE: True, Keys.PP_LAYER_RANGE: [0, 3]})
    check_agreement(p, [Built(Keys.POST_EXPERTS_ALL_REDUCE, True, "vllm"), Built(Keys.PP_LAYER_RANGE, [0, 3], "pp")])


def test_a_key_the_plan_does_not_hold_is_not_compared():
    assert disagreements(plan(), [Built(Keys.SHARED_EXPERTS_FUSION, True, "vllm")]) == []


def test_a_disagreement_stops_the_worker_naming_both_sides():
    p = plan(**{Keys.POST_EXPERTS_ALL_REDUCE: True, Keys.FORWARD_PATH: "normal"})
    built = [Built(Keys.POST_EXPERTS_ALL_REDUCE, False, "DeepEPLLPrepareAndFinalize.output_is_reduced()=True"),
             Built(Keys.FORWARD_PATH, "normal", "use_all2all_kernels=False")]
    with pytest.raises(PlanRefused) as e:
        check_agreement(p, built)
    text = str(e.value)
    assert "plan p1 (deployment prod, role target)" in text
    assert ("moe.post_experts_all_reduce: the plan says True (because moe.post_experts_all_reduce), vLLM builds "
            "False (DeepEPLLPrepareAndFinalize.output_is_reduced()=True)") in text
    assert Keys.FORWARD_PATH not in text
