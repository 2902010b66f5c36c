"""The public checkpoints of the issue resolve with the decisions DESIGN prescribes.

Fixtures: tests/data/configs/<name>/config.json (the published config.json files;
kimi-k2.5 is a K2.5-style wrapper around a DeepSeek-V3 body with 384 experts)."""

from __future__ import annotations

import copy

import pytest

from loadplan.plan import Keys, ResolveRequest
from loadplan.errors import FailedPrecondition, InvalidArgument
from loadplan.service.rules.resolve import resolve_decisions

from ._fixtures import REAL_CONFIGS, load_config, real_request, request


def decide(name, **kw):
    res = resolve_decisions(real_request(name, **kw))
    return res, res.decisions


@pytest.mark.parametrize("name,arch,routed_field,n_routed", [
    ("deepseek-v3", "DeepseekV3ForCausalLM", "n_routed_experts", 256),
    ("kimi-k2", "DeepseekV3ForCausalLM", "n_routed_experts", 384),
    ("glm-4.5", "Glm4MoeForCausalLM", "n_routed_experts", 160),
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", "num_experts", 128),
    ("qwen1.5-moe-a2.7b", "Qwen2MoeForCausalLM", "num_experts", 60),
    ("mixtral-8x7b", "MixtralForCausalLM", "num_local_experts", 8),
    ("gpt-oss-20b", "GptOssForCausalLM", "num_local_experts", 32),
])
def test_fixtures_are_the_published_shapes(name, arch, routed_field, n_routed):
    cfg = load_config(name)
    assert cfg["architectures"] == [arch]
    assert cfg[routed_field] == n_routed


def test_every_fixture_resolves_on_defaults():
    for name in REAL_CONFIGS:
        _, d = decide(name)
        assert d[Keys.FORWARD_PATH].value == "normal"


# --- DeepSeek-V3: 256 routed, 1 shared, fp8 block quantization -----------------------

def test_deepseek_v3_fuses_on_defaults():
    res, d = decide("deepseek-v3")
    assert res.quantization == "fp8"
    assert res.chain == ("DeepseekV3ForCausalLM",)
    assert d[Keys.SHARED_EXPERTS_FUSION].value is True
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "deepseek.fused"
    assert "routed slot 256" in d[Keys.SHARED_EXPERTS_FUSION].reason
    assert d[Keys.NUM_FUSED_SHARED_EXPERTS].value == 1
    assert d[Keys.FUSED_SHARED_EXPERT_SCALE].value == 1.0
    assert d[Keys.POST_EXPERTS_ALL_REDUCE].value is False
    assert d[Keys.PP_LAYER_RANGE].value == [0, 61]


def test_deepseek_v3_reads_the_quantization_in_its_config_json():
    res = resolve_decisions(request(load_config("deepseek-v3")))  # quantization_config not repeated
    assert res.quantization == "fp8"


def test_deepseek_v3_expert_parallel_normal_path():
    _, d = decide("deepseek-v3", ep_size=8)
    assert d[Keys.SHARED_EXPERTS_FUSION].value is True
    assert d[Keys.FUSED_SHARED_EXPERT_SCALE].value == pytest.approx(1 / 8)
    assert d[Keys.POST_EXPERTS_ALL_REDUCE].value is True
    assert d[Keys.NUM_LOCAL_EXPERTS].value == 32


def test_deepseek_v3_on_deepep():
    _, d = decide("deepseek-v3", ep_size=8, a2a_backend="deepep")
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "deepseek.deepep_class"
    assert d[Keys.FORWARD_PATH].value == "a2a"
    assert d[Keys.POST_EXPERTS_ALL_REDUCE].value is False
    _, d = decide("deepseek-v3", ep_size=8, a2a_backend="deepep", enforce_shared_experts_fusion=True)
    assert d[Keys.SHARED_EXPERTS_FUSION].value is True
    assert d[Keys.FUSED_SHARED_EXPERT_SCALE].value == 1.0


@pytest.mark.parametrize("device,fused,rule", [("cuda:9.0", False, "deepseek.expert_parallel"),
                                               ("hip:9.4", True, "deepseek.fused")])
def test_deepseek_v3_vendor_kernel_under_ep(device, fused, rule):
    _, d = decide("deepseek-v3", ep_size=8, engine="vendor-kernel", device=device)
    assert (d[Keys.SHARED_EXPERTS_FUSION].value, d[Keys.SHARED_EXPERTS_FUSION].rule) == (fused, rule)


def test_deepseek_v3_eplb_stages():
    layers = []
    for pp_rank in range(4):
        _, d = decide("deepseek-v3", enable_eplb=True, ep_num_redundant_experts=32, ep_size=8,
                      pp_size=4, pp_rank=pp_rank)
        assert d[Keys.EPLB_NUM_PHYSICAL_EXPERTS].value == 288
        assert d[Keys.NUM_LOCAL_EXPERTS].value == 36
        layers += d[Keys.EPLB_LAYERS].value
    assert layers == list(range(3, 61))  # first_k_dense_replace = 3


def test_deepseek_v3_nextn_draft():
    cfg = load_config("deepseek-v3")
    cfg["architectures"] = ["DeepseekV3ForCausalLMNextN"]
    res = resolve_decisions(request(cfg, role="speculative", quantization_config=cfg["quantization_config"],
                                    enable_eplb=True))
    d = res.decisions
    assert d[Keys.SHARED_EXPERTS_FUSION].value is True
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "deepseek_nextn.fused"
    assert d[Keys.PP_LAYER_RANGE].value == [61, 62]
    assert d[Keys.EPLB_LAYERS].value == [61]


@pytest.mark.parametrize("backend, fused, rule", [("none", True, "glm4_moe_nextn.fused"),
                                                   ("deepep", False, "glm4_moe.deepep_class")])
def test_glm_4_5_nextn_draft_is_planned_with_glms_gate(backend, fused, rule):
    """GLM-4.5's MTP layer (model.layers.92) as its own runner: GLM's gate, asked with the draft's own entry
    class as the fused architecture; the layer after the target's 92."""
    cfg = load_config("glm-4.5")
    cfg["architectures"] = ["Glm4MoeForCausalLMNextN"]
    res = resolve_decisions(request(cfg, role="speculative", a2a_backend=backend, ep_size=2, enable_eplb=True))
    d = res.decisions
    assert (res.family, d[Keys.SHARED_EXPERTS_FUSION].value, d[Keys.SHARED_EXPERTS_FUSION].rule) == (
        "glm4_moe_nextn", fused, rule)
    assert d[Keys.PP_LAYER_RANGE].value == [92, 93] and d[Keys.EPLB_LAYERS].value == [92]
    assert d[Keys.NUM_LOCAL_EXPERTS].value == 80


# --- Kimi-K2: DeepseekV3ForCausalLM with 384 routed experts, fp8 -----------------------

@pytest.mark.parametrize("enforced", [False, True])
def test_kimi_k2_is_not_fused_by_the_384_rule(enforced):
    res, d = decide("kimi-k2", enforce_shared_experts_fusion=enforced)
    assert res.quantization == "fp8"
    f = d[Keys.SHARED_EXPERTS_FUSION]
    assert f.value is False
    assert f.rule == "deepseek.structural.384_needs_quark"
    assert "384" in f.reason and "fp8" in f.reason and "quark" in f.reason
    assert d[Keys.NUM_FUSED_SHARED_EXPERTS].value == 0


def test_kimi_k2_quark_variant_fuses():
    _, d = decide("kimi-k2", quantization_config={"quant_method": "quark"})
    assert d[Keys.SHARED_EXPERTS_FUSION].value is True


def test_kimi_k2_layers_and_experts():
    _, d = decide("kimi-k2", ep_size=8, enable_eplb=True)
    assert d[Keys.NUM_LOCAL_EXPERTS].value == 48
    assert d[Keys.EPLB_LAYERS].value == list(range(1, 61))  # first_k_dense_replace = 1


# --- GLM-4.5 -----------------------------------------------------------------------------

def test_glm45_fuses_on_defaults():
    res, d = decide("glm-4.5")
    assert res.quantization is None
    assert d[Keys.SHARED_EXPERTS_FUSION].value is True
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "glm4_moe.fused"
    assert d[Keys.PP_LAYER_RANGE].value == [0, 92]


@pytest.mark.parametrize("kw,rule", [
    (dict(engine="vendor-kernel", device="musa:3.1"), "glm4_moe.device"),
    (dict(engine="vendor-kernel", device="cuda:9.0", ep_size=8), "glm4_moe.expert_parallel"),
    (dict(a2a_backend="mori", ep_size=8), "glm4_moe.deepep_class"),
    (dict(quantization="w4afp8"), "glm4_moe.quantization"),
    (dict(engine="vendor-kernel", device="hip:9.4", ep_size=8), "glm4_moe.fused"),
])
def test_glm45_gate(kw, rule):
    _, d = decide("glm-4.5", **kw)
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == rule
    assert d[Keys.SHARED_EXPERTS_FUSION].value is (rule == "glm4_moe.fused")


def test_glm45_stages_and_eplb():
    layers = []
    for pp_rank in range(4):
        _, d = decide("glm-4.5", enable_eplb=True, ep_size=8, pp_size=4, pp_rank=pp_rank)
        assert d[Keys.PP_LAYER_RANGE].value == [23 * pp_rank, 23 * (pp_rank + 1)]
        assert d[Keys.NUM_LOCAL_EXPERTS].value == 20
        layers += d[Keys.EPLB_LAYERS].value
    assert layers == list(range(3, 92))


# --- Qwen3-30B-A3B -----------------------------------------------------------------------

def test_qwen3_30b_has_no_shared_experts():
    res, d = decide("qwen3-30b-a3b", ep_size=8, enable_eplb=True)
    f = d[Keys.SHARED_EXPERTS_FUSION]
    assert (f.value, f.rule, f.reason) == (False, "qwen3_moe.no_shared_experts", "no shared experts")
    assert d[Keys.NUM_FUSED_SHARED_EXPERTS].value == 0
    assert d[Keys.NUM_LOCAL_EXPERTS].value == 16
    assert d[Keys.EPLB_LAYERS].value == list(range(48))
    assert d[Keys.POST_EXPERTS_ALL_REDUCE].value is True


# --- Mixtral-8x7B: 8 experts, top-2, every layer sparse, no shared expert -------------------

def test_mixtral_8x7b_over_eight_ep_ranks_on_deepep():
    res, d = decide("mixtral-8x7b", ep_size=8, ep_rank=5, a2a_backend="deepep", enable_eplb=True)
    f = d[Keys.SHARED_EXPERTS_FUSION]
    assert (f.value, f.rule, f.reason) == (False, "mixtral.no_shared_experts", "no shared experts")
    assert d[Keys.NUM_FUSED_SHARED_EXPERTS].value == 0
    assert d[Keys.NUM_LOCAL_EXPERTS].value == 1
    assert d[Keys.EPLB_LAYERS].value == list(range(32))
    assert d[Keys.FORWARD_PATH].value == "a2a"
    assert d[Keys.POST_EXPERTS_ALL_REDUCE].value is False
    with pytest.raises(FailedPrecondition):   # 8 experts do not spread over 16 ranks without redundant ones
        decide("mixtral-8x7b", ep_size=16)


# --- gpt-oss-20b: 32 experts, top-4, every layer sparse, no shared expert, MXFP4 experts ---------------

def test_gpt_oss_20b_over_four_ep_ranks_with_redundant_experts():
    res, d = decide("gpt-oss-20b", ep_size=4, ep_rank=3, enable_eplb=True, ep_num_redundant_experts=4)
    assert res.quantization == "mxfp4"            # read from its quantization_config
    f = d[Keys.SHARED_EXPERTS_FUSION]
    assert (f.value, f.rule, f.reason) == (False, "gpt_oss.no_shared_experts", "no shared experts")
    assert d[Keys.EPLB_NUM_PHYSICAL_EXPERTS].value == 36
    assert d[Keys.NUM_LOCAL_EXPERTS].value == 9
    assert d[Keys.EPLB_LAYERS].value == list(range(24))
    assert d[Keys.POST_EXPERTS_ALL_REDUCE].value is True
    with pytest.raises(FailedPrecondition):   # 32 experts do not spread over 64 ranks without redundant ones
        decide("gpt-oss-20b", ep_size=64)


# --- Qwen1.5-MoE-A2.7B: shared 5632 vs routed 1408 -----------------------------------------

@pytest.mark.parametrize("enforced", [False, True])
def test_qwen15_moe_is_not_fused_by_the_size_rule(enforced):
    _, d = decide("qwen1.5-moe-a2.7b", enforce_shared_experts_fusion=enforced)
    f = d[Keys.SHARED_EXPERTS_FUSION]
    assert f.value is False
    assert f.rule == "qwen2_moe.structural.intermediate_size"
    assert "5632" in f.reason and "1408" in f.reason


def test_qwen15_moe_60_experts_over_ep():
    _, d = decide("qwen1.5-moe-a2.7b", ep_size=4)
    assert d[Keys.NUM_LOCAL_EXPERTS].value == 15
    with pytest.raises(FailedPrecondition):
        decide("qwen1.5-moe-a2.7b", ep_size=8)
    _, d = decide("qwen1.5-moe-a2.7b", ep_size=8, enable_eplb=True, ep_num_redundant_experts=4)
    assert d[Keys.NUM_LOCAL_EXPERTS].value == 8


# --- Kimi-K2.5-style wrapper ----------------------------------------------------------

def test_kimi_k25_answers_through_text_config_and_top_level_quantization():
    res, d = decide("kimi-k2.5")
    assert res.chain == ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM")
    assert res.entry_class == "KimiK25ForConditionalGeneration"
    assert res.family == "deepseek"
    assert res.quantization == "compressed_tensors"
    f = d[Keys.SHARED_EXPERTS_FUSION]
    assert f.value is False and f.rule == "deepseek.structural.384_needs_quark"
    assert "compressed_tensors" in f.reason
    assert d[Keys.PP_LAYER_RANGE].value == [0, 61]


def test_kimi_k25_quark_variant_fuses():
    cfg = load_config("kimi-k2.5")
    cfg["quantization_config"] = {"quant_method": "quark", "export": {"kv_cache_group": []}}
    res = resolve_decisions(request(cfg, quantization_config=cfg["quantization_config"]))
    assert res.quantization == "quark"
    assert res.decisions[Keys.SHARED_EXPERTS_FUSION].value is True
    assert res.decisions[Keys.SHARED_EXPERTS_FUSION].rule == "deepseek.fused"


def test_kimi_k25_without_text_config():
    cfg = load_config("kimi-k2.5")
    del cfg["text_config"]
    with pytest.raises(InvalidArgument) as e:
        resolve_decisions(request(cfg, quantization_config=cfg["quantization_config"]))
    assert e.value.field == "config.text_config"


def test_resolving_does_not_mutate_the_request_config():
    cfg = load_config("kimi-k2.5")
    before = copy.deepcopy(cfg)
    resolve_decisions(ResolveRequest("req-1", "dep-1", config=cfg, quantization_config=cfg["quantization_config"]))
    assert cfg == before
