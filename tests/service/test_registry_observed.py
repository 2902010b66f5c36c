"""Observed plans (service/rules/observed.py): a runner of an SGLang release without a profile records what SGLang
decided; the history, pins and rank agreement hold as for a resolved plan, and the hazards the registry knows still
stop the start."""

from __future__ import annotations

import json
import pathlib

import pytest

from loadplan.errors import FailedPrecondition, InvalidArgument
from loadplan.plan import Decision, Keys, Parallel, ResolveRequest, Runtime
from loadplan.service.registry import PlanFilter, Registry
from loadplan.service.rules.engines import ENGINES
from loadplan.service.rules.observed import nearest_release
from loadplan.service.store.db import make_engine, migrate
from loadplan.service.store.repository import SqlPlanStore

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "data" / "configs"


def _config(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


@pytest.fixture
def registry(tmp_path):
    url = f"sqlite:///{tmp_path / 'h.db'}"
    migrate(url)
    engine = make_engine(url)
    yield Registry(SqlPlanStore(engine))
    engine.dispose()


def _request(rank: int = 0, version: str = "0.5.19", a2a: str = "none", config: str = "deepseek-v3",
             deployment: str = "dsv3-019") -> ResolveRequest:
    return ResolveRequest(request_id=f"{deployment}-{rank}", deployment_id=deployment,
                          parallel=Parallel(tp_size=8, tp_rank=rank), config=_config(config),
                          runtime=Runtime(a2a_backend=a2a, device="cuda:9.0", engine="sglang",
                                          engine_version=version))


def _fused(value: bool) -> list[Decision]:
    return [Decision(Keys.SHARED_EXPERTS_FUSION, value, "SGLang 0.5.19's install_shared_experts_fusion_decision",
                     "adapter"),
            Decision(Keys.NUM_FUSED_SHARED_EXPERTS, 1 if value else 0, "its model's own count", "adapter")]


def test_the_nearest_profiled_release_stands_for_an_unprofiled_one():
    sglang = ENGINES["sglang"]
    assert nearest_release(sglang, "0.5.19") == "0.5.20"        # older than every profile: the oldest
    assert nearest_release(sglang, "0.5.24") == "0.5.23"        # newer: the newest not newer
    assert nearest_release(sglang, "0.5.22.post1") == "0.5.22"


def test_an_observed_plan_records_what_the_engine_decided_and_says_so(registry):
    plan = registry.record_observed(_request(), _fused(False))
    assert plan.observed
    assert plan.request.runtime.engine_version == "0.5.19"
    profile = plan.decisions[Keys.ENGINE_PROFILE]
    assert profile.value == "sglang 0.5.19 (observed)" and "0.5.20" in profile.reason
    fused = plan.decisions[Keys.SHARED_EXPERTS_FUSION]
    assert (fused.value, fused.rule) == (False, "observed.sglang")
    forward = plan.decisions[Keys.FORWARD_PATH]
    assert forward.value == "normal" and forward.reason.startswith("as sglang 0.5.20's profile decides")
    stored = registry.get_plan(plan.plan_id)
    assert stored.observed
    assert {k: (d.value, d.rule) for k, d in stored.decisions.items()} == \
        {k: (d.value, d.rule) for k, d in plan.decisions.items()}
    assert not registry.resolve(_request(version="0.5.23", deployment="dsv3-023")).observed


def test_ranks_that_observed_different_decisions_are_refused_naming_the_key(registry):
    registry.record_observed(_request(0), _fused(True))
    registry.record_observed(_request(1), _fused(True))          # agrees
    with pytest.raises(FailedPrecondition) as e:
        registry.record_observed(_request(2), _fused(False))
    assert "observed.moe.shared_experts_fusion" in e.value.message


def test_a_deployment_mixing_releases_across_ranks_is_refused_naming_both(registry):
    registry.record_observed(_request(0), _fused(True))
    with pytest.raises(FailedPrecondition) as e:
        registry.resolve(_request(1, version="0.5.23"))
    assert "runtime.engine_version" in e.value.message and "'0.5.19'" in e.value.message \
        and "'0.5.23'" in e.value.message


def test_an_observed_forward_path_and_reduction_stand_over_the_nearest_profiles(registry):
    """vLLM's plugin observes the path and the reduction too: the plan holds what the engine built."""
    request = ResolveRequest(request_id="v-0", deployment_id="v", config=_config("qwen3-30b-a3b"),
                             parallel=Parallel(tp_size=2, tp_rank=0),
                             runtime=Runtime(engine="vllm", engine_version="0.33.0", device="cpu"))
    plan = registry.record_observed(request, [
        Decision(Keys.FORWARD_PATH, "a2a", "FusedMoEParallelConfig.use_all2all_kernels=True", "vllm.plugin"),
        Decision(Keys.POST_EXPERTS_ALL_REDUCE, False, "output_is_reduced()=True", "vllm.plugin")])
    assert plan.value(Keys.ENGINE_PROFILE) == "vllm 0.33.0 (observed)"
    assert (plan.value(Keys.FORWARD_PATH), plan.decisions[Keys.FORWARD_PATH].rule) == ("a2a", "observed.vllm")
    assert plan.value(Keys.POST_EXPERTS_ALL_REDUCE) is False
    nearest = plan.decisions[Keys.PP_LAYER_RANGE]
    assert nearest.reason.startswith("as vllm 0.32.0's profile decides")


def test_a_hazard_the_registry_knows_stops_an_observed_plan(registry):
    # the Qwen2-MoE block's normal branch all-reduces after mooncake's combine (SGLang 0.5.20's as 0.5.23's)
    with pytest.raises(FailedPrecondition, match=r"^hazard: sglang\.double_reduction: .*nearest profiled"):
        registry.record_observed(_request(config="qwen1.5-moe-a2.7b", a2a="mooncake", deployment="q"),
                                 _fused(False))
    # a shared expert SGLang fused, on a dispatch path without per-rank slots (nixl)
    with pytest.raises(FailedPrecondition, match=r"^hazard: sglang\.fused_global_slot_on_dispatch"):
        registry.record_observed(_request(a2a="nixl", deployment="n"), _fused(True))
    assert registry.list_plans(PlanFilter())[0] == []


def test_a_profiled_release_is_told_to_resolve_and_bad_observations_are_named(registry):
    with pytest.raises(FailedPrecondition, match="has a profile") as e:
        registry.record_observed(_request(version="0.5.22"), _fused(False))
    assert e.value.field == "runtime.engine_version"
    with pytest.raises(InvalidArgument) as e:
        registry.record_observed(_request(), [Decision(Keys.PP_LAYER_RANGE, [0, 61], "", "x")])
    assert e.value.field == "decisions"
    with pytest.raises(InvalidArgument, match="must be 'normal' or 'a2a'") as e:
        registry.record_observed(_request(), [Decision(Keys.FORWARD_PATH, "dispatch", "", "x")])
    assert e.value.field == "decisions[moe.forward_path].value"
    with pytest.raises(InvalidArgument, match="must be an int >= 0"):
        registry.record_observed(_request(), [Decision(Keys.NUM_FUSED_SHARED_EXPERTS, True, "", "x")])
    with pytest.raises(InvalidArgument) as e:
        registry.record_observed(_request(), [])
    assert e.value.field == "decisions"
    with pytest.raises(InvalidArgument) as e:
        registry.record_observed(_request(), _fused(False) * 2)
    assert e.value.field == "decisions[2].key"


def _on(version: str, rank: int, upgrade_from: str = "", config: str = "deepseek-v3", a2a: str = "none",
        deployment: str = "up", device: str = "cuda:9.0", **runtime) -> ResolveRequest:
    return ResolveRequest(request_id=f"{deployment}-{version}-{rank}", deployment_id=deployment,
                          parallel=Parallel(tp_size=8, tp_rank=rank), config=_config(config),
                          runtime=Runtime(a2a_backend=a2a, device=device, engine="sglang", engine_version=version,
                                          upgrade_from=upgrade_from, **runtime))


def test_an_upgrade_the_operator_named_mixes_releases_while_the_layout_agrees(registry):
    registry.resolve(_on("0.5.22", 0))
    registry.resolve(_on("0.5.23", 1, upgrade_from="0.5.22"))          # the same layout on both releases
    registry.resolve(_on("0.5.22", 2))                                  # the old release still joins
    with pytest.raises(FailedPrecondition) as e:                        # not named: refused naming both
        registry.resolve(_on("0.5.23", 3))
    assert "'0.5.22'" in e.value.message and "'0.5.23'" in e.value.message
    assert e.value.field == "runtime.engine_version"


def test_a_named_upgrade_that_changes_the_layout_is_refused_naming_it(registry):
    # Qwen1.5-MoE on ascend_fuseep: 0.5.23's Qwen2-MoE block dispatches it itself, 0.5.22 ran the normal branch
    flags = dict(config="qwen1.5-moe-a2.7b", a2a="ascend_fuseep", deployment="fuseep", device="cuda:10.0",
                 disable_shared_experts_fusion=True)
    registry.resolve(_on("0.5.22", 0, **flags))
    with pytest.raises(FailedPrecondition) as e:
        registry.resolve(_on("0.5.23", 1, upgrade_from="0.5.22", **flags))
    assert e.value.field == "runtime.engine_version" and "layout" in e.value.message
    with pytest.raises(InvalidArgument) as e:
        registry.resolve(_on("0.5.23", 1, upgrade_from="0.5.23", deployment="self"))
    assert e.value.field == "runtime.upgrade_from"
