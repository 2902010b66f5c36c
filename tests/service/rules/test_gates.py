"""Every branch of every shared-experts fusion gate (DESIGN 5.2), asked through
the resolver so the intent handling around the gates is exercised too."""

from __future__ import annotations

import dataclasses

import pytest

from loadplan.plan import Keys
from loadplan.errors import InvalidArgument
from loadplan.service.rules import entries

from ._fixtures import deepseek, fusion, glm4, kimi_k25, qwen2, qwen3, resolve

ENFORCE = {"enforce_shared_experts_fusion": True}
DEEPEP_CLASS = ["deepep", "mooncake", "mori"]
NO_FUSION_Q = ["w4afp8", "wint4afp8", "wint4a16"]


def assert_off(d, rule, *facts):
    assert d.value is False, d
    assert d.rule == rule, d
    assert d.reason, d
    for fact in facts:
        assert fact in d.reason, (fact, d.reason)


def assert_fused(d, family):
    assert d.value is True, d
    assert d.rule == f"{family}.fused", d


# --- user intent (rules 1-2) ------------------------------------------------

@pytest.mark.parametrize("cfg", [deepseek(), glm4(), qwen2(), kimi_k25(deepseek())], ids=lambda c: c["architectures"][0])
def test_disable_intent_wins(cfg):
    assert_fused(fusion(cfg), resolve(cfg).family)
    for kw in ({}, ENFORCE):
        d = fusion(cfg, disable_shared_experts_fusion=True, **kw)
        assert_off(d, "intent.disable_shared_experts_fusion", "disable_shared_experts_fusion")


def test_disable_intent_does_not_ask_the_gate(monkeypatch):
    def boom(ctx):
        raise AssertionError("gate asked")

    monkeypatch.setitem(entries.FAMILIES, "deepseek", dataclasses.replace(entries.FAMILIES["deepseek"], gate=boom))
    d = fusion(deepseek(n_shared_experts=2), disable_shared_experts_fusion=True)
    assert_off(d, "intent.disable_shared_experts_fusion")
    with pytest.raises(AssertionError, match="gate asked"):
        fusion(deepseek())


def test_disabled_fusion_has_no_fused_slots():
    d = resolve(deepseek(), disable_shared_experts_fusion=True, ep_size=2).decisions
    assert d[Keys.NUM_FUSED_SHARED_EXPERTS].value == 0
    assert d[Keys.NUM_FUSED_SHARED_EXPERTS].reason
    assert d[Keys.FUSED_SHARED_EXPERT_SCALE].value == 1.0


# --- DeepSeek: defaults ------------------------------------------------------

@pytest.mark.parametrize("n_routed", [256, 384])
def test_deepseek_fuses_on_defaults(n_routed):
    q = "quark" if n_routed == 384 else None
    res = resolve(deepseek(n_routed_experts=n_routed), quantization=q)
    assert_fused(res.decisions[Keys.SHARED_EXPERTS_FUSION], "deepseek")
    assert res.decisions[Keys.NUM_FUSED_SHARED_EXPERTS].value == 1
    assert str(n_routed) in res.decisions[Keys.SHARED_EXPERTS_FUSION].reason  # the slot's index


# --- DeepSeek rule 3: SBO / TBO -------------------------------------------

@pytest.mark.parametrize("flag", ["enable_sbo", "enable_tbo"])
def test_deepseek_overlap_disables(flag):
    assert_off(fusion(deepseek(), **{flag: True}), "deepseek.overlap", "SBO/TBO")
    assert_fused(fusion(deepseek(), **{flag: True}, **ENFORCE), "deepseek")


# --- DeepSeek rule 4: structural, never skipped -----------------------------

@pytest.mark.parametrize("kw", [{}, ENFORCE], ids=["plain", "enforced"])
def test_deepseek_v2_never_fuses(kw):
    d = fusion(deepseek(architectures=["DeepseekV2ForCausalLM"]), **kw)
    assert_off(d, "deepseek.structural.architecture", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@pytest.mark.parametrize("kw", [{}, ENFORCE], ids=["plain", "enforced"])
@pytest.mark.parametrize("n_routed", [8, 64, 160, 255, 257, 383, 385, 512])
def test_deepseek_structural_n_routed(n_routed, kw):
    d = fusion(deepseek(n_routed_experts=n_routed), quantization="quark", **kw)
    assert_off(d, "deepseek.structural.n_routed_experts", f"n_routed_experts={n_routed}")


@pytest.mark.parametrize("kw", [{}, ENFORCE], ids=["plain", "enforced"])
@pytest.mark.parametrize("n_shared", [2, 3])
def test_deepseek_structural_n_shared(n_shared, kw):
    d = fusion(deepseek(n_shared_experts=n_shared), **kw)
    assert_off(d, "deepseek.structural.n_shared_experts", f"n_shared_experts={n_shared}")


@pytest.mark.parametrize("kw", [{}, ENFORCE], ids=["plain", "enforced"])
def test_deepseek_without_shared_experts(kw):
    assert_off(fusion(deepseek(n_shared_experts=0), **kw), "deepseek.no_shared_experts", "no shared experts")


@pytest.mark.parametrize("kw", [{}, ENFORCE], ids=["plain", "enforced"])
@pytest.mark.parametrize("quant,shown", [(None, "none"), ("fp8", "fp8"), ("compressed-tensors", "compressed_tensors"),
                                         ("w4afp8", "w4afp8"), ("modelopt", "modelopt")])
def test_deepseek_384_without_quark_would_mis_load(quant, shown, kw):
    d = fusion(deepseek(n_routed_experts=384), quantization=quant, **kw)
    assert_off(d, "deepseek.structural.384_needs_quark", "384", "quark", f"quantization {shown}")


def test_deepseek_384_with_quark_from_either_source():
    assert_fused(fusion(deepseek(n_routed_experts=384), quantization="quark"), "deepseek")
    assert_fused(fusion(deepseek(n_routed_experts=384), quantization_config={"quant_method": "quark"}), "deepseek")
    assert_fused(fusion(deepseek(n_routed_experts=384, quantization_config={"quant_method": "quark"})), "deepseek")
    assert_fused(fusion(deepseek(), quantization="quark"), "deepseek")  # quark is fine for 256 too


# --- DeepSeek rule 5: DeepEP-class backends ------------------------------------

@pytest.mark.parametrize("backend", DEEPEP_CLASS)
@pytest.mark.parametrize("ep_size", [1, 2])
def test_deepseek_deepep_class_off_unless_enforced(backend, ep_size):
    assert_off(fusion(deepseek(), a2a_backend=backend, ep_size=ep_size), "deepseek.deepep_class", backend)
    assert_fused(fusion(deepseek(), a2a_backend=backend, ep_size=ep_size, **ENFORCE), "deepseek")


@pytest.mark.parametrize("backend", ["none", "nixl", "ascend_fuseep", "megamoe"])
def test_deepseek_other_backends_fuse_at_ep1(backend):
    assert_fused(fusion(deepseek(), a2a_backend=backend), "deepseek")


# --- DeepSeek rule 6: device ---------------------------------------------------

@pytest.mark.parametrize("device,ok", [
    ("cuda:7.5", False), ("cuda:7.9", False), ("cuda:8.0", True), ("cuda:9.0", True),
    ("hip:9.3", False), ("hip:9.4", True), ("hip:10.0", True),
    ("musa:3.0", False), ("musa:3.1", True), ("musa:4.0", True),
])
def test_deepseek_device_threshold_for_the_vendor_kernel(device, ok):
    d = fusion(deepseek(), engine="vendor-kernel", device=device)
    if ok:
        assert_fused(d, "deepseek")
    else:
        assert_off(d, "deepseek.device", device, "kernel")
        assert_fused(fusion(deepseek(), engine="vendor-kernel", device=device, **ENFORCE), "deepseek")


@pytest.mark.parametrize("device", ["cpu", "cuda:7.0", "hip:9.0", "musa:2.0"])
def test_deepseek_torch_runner_fuses_on_any_device(device):
    assert_fused(fusion(deepseek(), engine="loadplan", device=device), "deepseek")


# --- DeepSeek rule 7: expert parallelism -------------------------------------

@pytest.mark.parametrize("device,engine,ok", [
    ("cuda:9.0", "vendor-kernel", False), ("cuda:12.0", "vendor-kernel", False), ("musa:3.1", "vendor-kernel", False),
    ("hip:9.4", "vendor-kernel", True), ("hip:9.5", "vendor-kernel", True),
    ("cpu", "loadplan", True), ("cuda:9.0", "loadplan", True),
])
@pytest.mark.parametrize("ep_size", [2, 8])
def test_deepseek_expert_parallel(device, engine, ok, ep_size):
    d = fusion(deepseek(), engine=engine, device=device, ep_size=ep_size)
    if ok:
        assert_fused(d, "deepseek")
    else:
        assert_off(d, "deepseek.expert_parallel", f"ep_size={ep_size}", device)
        assert_fused(fusion(deepseek(), engine=engine, device=device, ep_size=ep_size, **ENFORCE), "deepseek")
    assert_fused(fusion(deepseek(), engine=engine, device=device, ep_size=1), "deepseek")


def test_deepseek_device_is_checked_before_expert_parallel():
    d = fusion(deepseek(), engine="vendor-kernel", device="hip:9.3", ep_size=2)
    assert_off(d, "deepseek.device")


# --- DeepSeek rule 8: quantization -----------------------------------------

@pytest.mark.parametrize("quant", NO_FUSION_Q)
def test_deepseek_quantization_without_fused_kernel(quant):
    assert_off(fusion(deepseek(), quantization=quant), "deepseek.quantization", quant)
    assert_off(fusion(deepseek(), quantization_config={"quant_method": quant.upper()}), "deepseek.quantization", quant)
    assert_fused(fusion(deepseek(), quantization=quant, **ENFORCE), "deepseek")


@pytest.mark.parametrize("quant", ["fp8", "compressed-tensors", "awq", "quark", "w8a8_int8"])
def test_deepseek_other_quantizations_fuse(quant):
    assert_fused(fusion(deepseek(), quantization=quant), "deepseek")


# --- DeepSeek: order (the first hit names the reason) -------------------------

def test_deepseek_rules_apply_in_design_order():
    every = dict(enable_sbo=True, a2a_backend="deepep", engine="vendor-kernel", device="cuda:7.0", ep_size=2,
                 quantization="w4afp8")
    cfg = deepseek(n_routed_experts=128)
    steps = [
        ("deepseek.overlap", {}),
        ("deepseek.structural.n_routed_experts", {"enable_sbo": False}),
        ("deepseek.deepep_class", {}),
        ("deepseek.device", {"a2a_backend": "none"}),
        ("deepseek.expert_parallel", {"device": "cuda:9.0"}),
        ("deepseek.quantization", {"ep_size": 1}),
    ]
    for rule, change in steps:
        every.update(change)
        if rule == "deepseek.deepep_class":
            cfg = deepseek()
        assert fusion(cfg, **every).rule == rule
    every["quantization"] = None
    assert_fused(fusion(cfg, **every), "deepseek")


def test_structural_rules_apply_in_design_order():
    cfg = deepseek(architectures=["DeepseekV2ForCausalLM"], n_routed_experts=384, n_shared_experts=2)
    assert fusion(cfg).rule == "deepseek.structural.architecture"
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["n_routed_experts"] = 100
    assert fusion(cfg).rule == "deepseek.structural.n_routed_experts"
    cfg["n_routed_experts"] = 384
    assert fusion(cfg).rule == "deepseek.structural.n_shared_experts"
    cfg["n_shared_experts"] = 1
    assert fusion(cfg).rule == "deepseek.structural.384_needs_quark"


# --- DeepSeek NextN draft: its own fused architecture ---------------------

def test_nextn_draft_class_declares_its_own_fused_architecture():
    cfg = deepseek(architectures=["DeepseekV3ForCausalLMNextN"], num_nextn_predict_layers=1)
    res = resolve(cfg, role="speculative")
    assert res.family == "deepseek_nextn"
    assert_fused(res.decisions[Keys.SHARED_EXPERTS_FUSION], "deepseek_nextn")


def test_nextn_draft_keeps_every_other_deepseek_rule():
    cfg = deepseek(architectures=["DeepseekV3ForCausalLMNextN"], num_nextn_predict_layers=1)
    assert_off(fusion(cfg, quantization="w4afp8", role="speculative"), "deepseek.quantization")
    assert_off(fusion(cfg, a2a_backend="mori", role="speculative"), "deepseek.deepep_class")
    cfg["n_routed_experts"] = 384
    assert_off(fusion(cfg, role="speculative", **ENFORCE), "deepseek.structural.384_needs_quark")


def test_draft_quantized_differently_does_not_touch_the_target():
    """The seed bug: building the draft rewrote the target's decision. Here each runner
    is resolved from its own inputs only."""
    target = resolve(deepseek(), quantization="fp8")
    draft = resolve(deepseek(architectures=["DeepseekV3ForCausalLMNextN"]), quantization="w4afp8",
                    role="speculative")
    again = resolve(deepseek(), quantization="fp8")
    assert draft.decisions[Keys.SHARED_EXPERTS_FUSION].value is False
    assert target.decisions[Keys.SHARED_EXPERTS_FUSION].value is True
    assert again.decisions == target.decisions


# --- GLM-4-MoE -----------------------------------------------------------------

def test_glm_fuses_on_defaults():
    assert_fused(fusion(glm4()), "glm4_moe")


@pytest.mark.parametrize("kw", [{}, ENFORCE], ids=["plain", "enforced"])
def test_glm_structural_n_shared(kw):
    assert_off(fusion(glm4(n_shared_experts=2), **kw), "glm4_moe.structural.n_shared_experts", "n_shared_experts=2")
    assert_off(fusion(glm4(n_shared_experts=0), **kw), "glm4_moe.no_shared_experts", "no shared experts")


MODELOPT_FP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4",
                "exclude_modules": ["lm_head", "model.layers.3.mlp.shared_experts*"]}


@pytest.mark.parametrize("kw", [{}, ENFORCE], ids=["plain", "enforced"])
def test_glm_modelopt_fp4_excluding_shared_experts(kw):
    d = fusion(glm4(), quantization_config=MODELOPT_FP4, **kw)
    assert_off(d, "glm4_moe.structural.modelopt_fp4_excludes_shared", "ModelOpt FP4", "shared experts")
    d = fusion(glm4(), quantization="modelopt_fp4", quantization_config={"ignore": ["re:.*shared_experts.*"]}, **kw)
    assert d.rule == "glm4_moe.structural.modelopt_fp4_excludes_shared"


def test_glm_modelopt_without_the_shared_exclusion_fuses():
    assert_fused(fusion(glm4(), quantization_config={**MODELOPT_FP4, "exclude_modules": ["lm_head"]}), "glm4_moe")
    assert_fused(fusion(glm4(), quantization_config={**MODELOPT_FP4, "quant_algo": "FP8"}), "glm4_moe")


@pytest.mark.parametrize("device,ok", [
    ("cuda:7.5", False), ("cuda:8.0", True), ("cuda:9.0", True),
    ("hip:9.3", False), ("hip:9.4", True),
    ("musa:3.1", False), ("musa:9.9", False),  # DESIGN lists CUDA and HIP only for GLM
])
def test_glm_device(device, ok):
    d = fusion(glm4(), engine="vendor-kernel", device=device)
    if ok:
        assert_fused(d, "glm4_moe")
    else:
        assert_off(d, "glm4_moe.device", device)
        assert_fused(fusion(glm4(), engine="vendor-kernel", device=device, **ENFORCE), "glm4_moe")


def test_glm_torch_runner_fuses():
    assert_fused(fusion(glm4(), engine="loadplan", device="cpu"), "glm4_moe")


@pytest.mark.parametrize("device,engine,ok", [("cuda:9.0", "vendor-kernel", False), ("hip:9.4", "vendor-kernel", True),
                                              ("cpu", "loadplan", True)])
def test_glm_expert_parallel_only_on_hip94(device, engine, ok):
    d = fusion(glm4(), engine=engine, device=device, ep_size=2)
    if ok:
        assert_fused(d, "glm4_moe")
    else:
        assert_off(d, "glm4_moe.expert_parallel", "ep_size=2")
        assert_fused(fusion(glm4(), engine=engine, device=device, ep_size=2, **ENFORCE), "glm4_moe")


@pytest.mark.parametrize("backend", DEEPEP_CLASS)
def test_glm_deepep_class(backend):
    assert_off(fusion(glm4(), a2a_backend=backend), "glm4_moe.deepep_class", backend)
    assert_fused(fusion(glm4(), a2a_backend=backend, **ENFORCE), "glm4_moe")


def test_glm_w4afp8_only():
    assert_off(fusion(glm4(), quantization="w4afp8"), "glm4_moe.quantization", "w4afp8")
    assert_fused(fusion(glm4(), quantization="w4afp8", **ENFORCE), "glm4_moe")
    for other in ("wint4afp8", "wint4a16", "fp8"):
        assert_fused(fusion(glm4(), quantization=other), "glm4_moe")


def test_glm_has_no_overlap_rule():
    assert_fused(fusion(glm4(), enable_sbo=True, enable_tbo=True), "glm4_moe")


# --- Qwen2-MoE ----------------------------------------------------------------

def test_qwen2_fuses_when_the_shared_expert_fits_a_slot():
    res = resolve(qwen2())
    assert_fused(res.decisions[Keys.SHARED_EXPERTS_FUSION], "qwen2_moe")
    assert res.decisions[Keys.NUM_FUSED_SHARED_EXPERTS].value == 1


@pytest.mark.parametrize("kw", [{}, ENFORCE], ids=["plain", "enforced"])
@pytest.mark.parametrize("shared,routed", [(5632, 1408), (1408, 5632), (1409, 1408)])
def test_qwen2_structural_sizes(shared, routed, kw):
    d = fusion(qwen2(shared_expert_intermediate_size=shared, moe_intermediate_size=routed), **kw)
    assert_off(d, "qwen2_moe.structural.intermediate_size", str(shared), str(routed))


@pytest.mark.parametrize("field", ["moe_intermediate_size", "shared_expert_intermediate_size"])
def test_qwen2_missing_width_is_refused_naming_it(field):
    # transformers' default widths differ by family (Qwen2-MoE 1408 / 5632, Qwen3-Next 512 / 512): not ours to guess
    cfg = qwen2()
    del cfg[field]
    with pytest.raises(InvalidArgument) as e:
        fusion(cfg)
    assert e.value.field == f"config.{field}"


@pytest.mark.parametrize("kw", [{}, ENFORCE], ids=["plain", "enforced"])
def test_qwen2_without_a_shared_expert(kw):
    assert_off(fusion(qwen2(shared_expert_intermediate_size=0), **kw), "qwen2_moe.no_shared_experts",
               "no shared experts")


@pytest.mark.parametrize("backend", DEEPEP_CLASS)
def test_qwen2_deepep_class(backend):
    assert_off(fusion(qwen2(), a2a_backend=backend), "qwen2_moe.deepep_class", backend)
    assert_fused(fusion(qwen2(), a2a_backend=backend, **ENFORCE), "qwen2_moe")


@pytest.mark.parametrize("quant", NO_FUSION_Q)
def test_qwen2_quantization(quant):
    assert_off(fusion(qwen2(), quantization=quant), "qwen2_moe.quantization", quant)
    assert_fused(fusion(qwen2(), quantization=quant, **ENFORCE), "qwen2_moe")


def test_qwen2_lists_no_device_or_ep_condition():
    """DESIGN 5.2 lists Qwen2-MoE's conditions exhaustively: sizes, backend, quantization."""
    assert_fused(fusion(qwen2(), engine="vendor-kernel", device="cuda:7.0", ep_size=2), "qwen2_moe")


@pytest.mark.parametrize("ep_size", [2, 4])
def test_qwen2_sigmoid_gated_slot_is_scaled_on_the_normal_path(ep_size):
    d = resolve(qwen2(), ep_size=ep_size).decisions
    assert d[Keys.FUSED_SHARED_EXPERT_SCALE].value == pytest.approx(1 / ep_size)


# --- Qwen3-MoE --------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, ENFORCE, {"a2a_backend": "deepep"}, {"quantization": "quark"}])
def test_qwen3_has_no_shared_experts(kw):
    # a stray shared size in the config does not make Qwen3-MoE build a shared expert
    for cfg in (qwen3(), qwen3(shared_expert_intermediate_size=768)):
        res = resolve(cfg, **kw)
        assert_off(res.decisions[Keys.SHARED_EXPERTS_FUSION], "qwen3_moe.no_shared_experts", "no shared experts")
        assert res.decisions[Keys.NUM_FUSED_SHARED_EXPERTS].value == 0
        assert res.decisions[Keys.FUSED_SHARED_EXPERT_SCALE].value == 1.0


# --- Kimi-K2.5 wrapper ---------------------------------------------------------

def test_wrapper_asks_the_deepseek_gate_with_its_text_config():
    # the top level carries values that would fail; only text_config counts
    cfg = kimi_k25(deepseek(), n_routed_experts=3, n_shared_experts=5, num_hidden_layers=1)
    res = resolve(cfg)
    assert res.chain == ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM")
    assert res.family == "deepseek"
    assert_fused(res.decisions[Keys.SHARED_EXPERTS_FUSION], "deepseek")
    assert res.decisions[Keys.PP_LAYER_RANGE].value == [0, 4]
    d = fusion(kimi_k25(deepseek(n_routed_experts=128)))
    assert_off(d, "deepseek.structural.n_routed_experts", "n_routed_experts=128")


def test_wrapper_hands_down_the_top_level_quantization():
    quark = {"quant_method": "quark"}
    ct = {"quant_method": "compressed-tensors"}
    # top level only
    assert_off(fusion(kimi_k25(quantization_config=ct)), "deepseek.structural.384_needs_quark", "compressed_tensors")
    assert_fused(fusion(kimi_k25(quantization_config=quark)), "deepseek")
    # the request's quantization config is the checkpoint's top level
    assert_fused(fusion(kimi_k25(), quantization_config=quark), "deepseek")
    # top level wins over one inside text_config
    body = deepseek(n_routed_experts=384, quantization_config=ct)
    assert_fused(fusion(kimi_k25(body, quantization_config=quark)), "deepseek")
    # ... which is the fallback when the top level declares none
    assert_fused(fusion(kimi_k25(deepseek(n_routed_experts=384, quantization_config=quark))), "deepseek")
    # an explicit name wins over both
    assert_off(fusion(kimi_k25(quantization_config=quark), quantization="fp8"), "deepseek.structural.384_needs_quark",
               "fp8")
    assert resolve(kimi_k25(quantization_config=ct)).quantization == "compressed_tensors"


def test_wrapper_keeps_every_deepseek_rule():
    cfg = kimi_k25(deepseek())
    assert_off(fusion(cfg, enable_tbo=True), "deepseek.overlap")
    assert_off(fusion(cfg, a2a_backend="mooncake"), "deepseek.deepep_class")
    assert_off(fusion(cfg, quantization="wint4a16"), "deepseek.quantization")
    assert_off(fusion(cfg, engine="vendor-kernel", device="cuda:9.0", ep_size=2), "deepseek.expert_parallel")


# --- Llama 4 (not in DESIGN 5.2: our gate) ----------------------------------------

def llama4(**over):
    cfg = {"architectures": ["Llama4ForCausalLM"], "num_hidden_layers": 48, "num_local_experts": 128,
           "num_experts_per_tok": 1, "interleave_moe_layer_step": 2}
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("runtime", [{}, {"enforce_shared_experts_fusion": True}, {"a2a_backend": "deepep"}])
def test_llama4_never_fuses_its_shared_expert_even_when_enforced(runtime):
    """Its routed experts scale their input by the router score: a fused slot could not carry 1/ep_size."""
    res = resolve(llama4(), **runtime)
    assert_off(res.decisions[Keys.SHARED_EXPERTS_FUSION], "llama4.structural.input_scaled_experts",
               "scale their input")
    assert res.decisions[Keys.NUM_FUSED_SHARED_EXPERTS].value == 0
    assert res.family == "llama4"


def test_the_llama4_wrapper_asks_the_gate_with_its_text_config():
    cfg = {"architectures": ["Llama4ForConditionalGeneration"], "num_hidden_layers": 1, "text_config": llama4()}
    res = resolve(cfg, ep_size=8, ep_rank=3, enable_eplb=True)
    assert res.chain == ("Llama4ForConditionalGeneration", "Llama4ForCausalLM")
    assert_off(res.decisions[Keys.SHARED_EXPERTS_FUSION], "llama4.structural.input_scaled_experts", "")
    assert res.decisions[Keys.EPLB_LAYERS].value == list(range(1, 48, 2))     # every second layer is MoE
    assert res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 16


# --- GLM-4-MoE-Lite (GLM-4.7-Flash): GLM-4-MoE's gate ------------------------------

def glm4_lite(**over):
    cfg = {"architectures": ["Glm4MoeLiteForCausalLM"], "num_hidden_layers": 47, "n_routed_experts": 64,
           "n_shared_experts": 1, "num_experts_per_tok": 4}
    cfg.update(over)
    return cfg


def test_glm4_moe_lite_is_asked_the_glm4_moe_gate():
    res = resolve(glm4_lite())
    assert res.family == "glm4_moe_lite"
    assert_fused(res.decisions[Keys.SHARED_EXPERTS_FUSION], "glm4_moe_lite")
    assert res.decisions[Keys.NUM_FUSED_SHARED_EXPERTS].value == 1
    assert_off(fusion(glm4_lite(), a2a_backend="deepep", ep_size=2), "glm4_moe.deepep_class", "DeepEP-class")
    assert_off(fusion(glm4_lite(n_shared_experts=2)), "glm4_moe.structural.n_shared_experts", "n_shared_experts=2")


def test_the_qwen3_vl_moe_wrapper_plans_its_text_model():
    cfg = {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "num_hidden_layers": 1,
           "text_config": qwen3(num_hidden_layers=48, num_experts=128)}
    res = resolve(cfg, ep_size=8, ep_rank=2)
    assert res.chain == ("Qwen3VLMoeForConditionalGeneration", "Qwen3MoeForCausalLM")
    assert_off(res.decisions[Keys.SHARED_EXPERTS_FUSION], "qwen3_moe.no_shared_experts", "no shared experts")
    assert res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 16
    assert res.decisions[Keys.PP_LAYER_RANGE].value == [0, 48]


# --- Qwen3-Next: linear-attention layers, Qwen2-MoE's MoE block and gate ---------------------

def qwen3_next(**over):
    """The published Qwen3-Next-80B-A3B sizes that the rules read: 512 experts, top-10, a shared expert as wide as
    an expert (512), every layer sparse."""
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 48, "num_experts": 512,
           "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "full_attention_interval": 4}
    cfg.update(over)
    return cfg


def test_qwen3_next_is_asked_the_qwen2_moe_gate():
    res = resolve(qwen3_next(), ep_size=8, ep_rank=1)
    assert res.family == "qwen3_next"
    assert_fused(res.decisions[Keys.SHARED_EXPERTS_FUSION], "qwen3_next")
    assert res.decisions[Keys.NUM_FUSED_SHARED_EXPERTS].value == 1
    assert res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 64
    assert res.decisions[Keys.PP_LAYER_RANGE].value == [0, 48]
    assert_off(fusion(qwen3_next(), a2a_backend="deepep", ep_size=2), "qwen2_moe.deepep_class", "DeepEP-class")
    assert_off(fusion(qwen3_next(shared_expert_intermediate_size=1024)), "qwen2_moe.structural.intermediate_size",
               "shared_expert_intermediate_size=1024 != moe_intermediate_size=512")


def test_the_qwen3_5_moe_wrapper_asks_the_qwen2_moe_gate_with_its_text_config():
    text = {k: v for k, v in qwen3_next(num_hidden_layers=40, num_experts=256, num_experts_per_tok=8).items()
            if k not in ("architectures", "decoder_sparse_step", "mlp_only_layers")}
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text}
    res = resolve(cfg, ep_size=8, ep_rank=7)
    assert res.chain == ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
    assert res.family == "qwen3_5_moe"
    assert_fused(res.decisions[Keys.SHARED_EXPERTS_FUSION], "qwen3_5_moe")
    assert res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 32
    narrower = dict(cfg, text_config=dict(text, shared_expert_intermediate_size=256))
    assert_off(fusion(narrower), "qwen2_moe.structural.intermediate_size", "shared_expert_intermediate_size=256")


def test_deepseek_v32_is_the_deepseek_family_and_never_fused():
    """Not the fused architecture (condition 4, structural: enforce does not lift it), as SGLang decides it."""
    cfg = dict(deepseek(), architectures=["DeepseekV32ForCausalLM"], index_topk=2048, index_n_heads=64,
               index_head_dim=128)
    res = resolve(cfg, ep_size=8, ep_rank=0)
    assert res.family == "deepseek"
    for kw in ({}, ENFORCE):
        assert_off(fusion(cfg, **kw), "deepseek.structural.architecture",
                   "DeepseekV32ForCausalLM is not the fused architecture DeepseekV3ForCausalLM")
    assert res.decisions[Keys.NUM_FUSED_SHARED_EXPERTS].value == 0


def test_the_qwen3_next_mtp_draft_plans_its_one_layer_after_the_targets_with_the_qwen2_moe_gate():
    res = resolve(qwen3_next(architectures=["Qwen3NextForCausalLMMTP"]), role="speculative", ep_size=8, ep_rank=2)
    assert res.family == "qwen3_next_nextn"
    assert res.decisions[Keys.PP_LAYER_RANGE].value == [48, 49]
    assert_fused(res.decisions[Keys.SHARED_EXPERTS_FUSION], "qwen3_next_nextn")
    assert_off(fusion(qwen3_next(architectures=["Qwen3NextForCausalLMMTP"]), a2a_backend="deepep", ep_size=2),
               "qwen2_moe.deepep_class", "DeepEP-class")


def test_the_qwen3_5_mtp_draft_reads_the_wrappers_text_config_or_its_own():
    """SGLang plans every Qwen3.5 draft as Qwen3_5ForCausalLMMTP on the target's config.json: the Hub wrapper's (its
    text model's config under text_config, the quantization at the top) or the text model's own."""
    text = {k: v for k, v in qwen3_next(num_hidden_layers=40, num_experts=256, num_experts_per_tok=8,
                                        mtp_num_hidden_layers=1).items()
            if k not in ("architectures", "decoder_sparse_step", "mlp_only_layers")}
    wrapped = {"architectures": ["Qwen3_5ForCausalLMMTP"], "text_config": text}
    flat = dict(text, architectures=["Qwen3_5ForCausalLMMTP"])
    for cfg in (wrapped, flat):
        res = resolve(cfg, role="speculative", ep_size=8, ep_rank=3)
        assert (res.chain, res.family) == (("Qwen3_5ForCausalLMMTP",), "qwen3_5_nextn")
        assert res.decisions[Keys.PP_LAYER_RANGE].value == [40, 41]
        assert res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 32
        assert_fused(res.decisions[Keys.SHARED_EXPERTS_FUSION], "qwen3_5_nextn")
    assert_off(fusion(dict(wrapped, quantization_config={"quant_method": "w4afp8"})), "qwen2_moe.quantization",
               "w4afp8")
    narrower = dict(wrapped, text_config=dict(text, shared_expert_intermediate_size=1024))
    assert_off(fusion(narrower), "qwen2_moe.structural.intermediate_size", "shared_expert_intermediate_size=1024")
    with pytest.raises(InvalidArgument) as e:
        resolve(dict(wrapped, text_config=dict(text, mtp_num_hidden_layers=0)), role="speculative")
    assert e.value.field == "config.text_config.mtp_num_hidden_layers"


def test_dots1_is_the_deepseek_family_and_never_fused():
    """dots.llm1's MoE is DeepSeek-V3's (its config names it alike): not the fused architecture (structural, so
    enforce does not lift it), and it ships two shared experts."""
    cfg = dict(deepseek(n_shared_experts=2, first_k_dense_replace=1), architectures=["Dots1ForCausalLM"])
    res = resolve(cfg, ep_size=8, ep_rank=2)
    assert res.family == "deepseek" and res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 32
    for kw in ({}, ENFORCE):
        assert_off(fusion(cfg, **kw), "deepseek.structural.architecture",
                   "Dots1ForCausalLM is not the fused architecture DeepseekV3ForCausalLM")


def test_ernie4_5_moe_is_its_own_family_and_never_fused():
    """ERNIE-4.5 (its config names the experts moe_*): its two shared experts have no fused layout (structural, so
    enforce does not lift it); without shared experts the plan says so."""
    cfg = {"architectures": ["Ernie4_5_MoeForCausalLM"], "num_hidden_layers": 28, "moe_num_experts": 64, "moe_k": 6,
           "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": 27}
    res = resolve(cfg, ep_size=8, ep_rank=3)
    assert res.family == "ernie4_5_moe" and res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 8
    for kw in ({}, ENFORCE):
        assert_off(fusion(cfg, **kw), "ernie4_5_moe.structural.no_fused_layout", "2 shared expert(s)")
    assert_off(fusion(dict(cfg, moe_num_shared_experts=0)), "ernie4_5_moe.no_shared_experts", "no shared experts")


def test_granitemoe_shared_is_never_fused_and_granitemoe_has_no_shared_experts():
    base = {"num_hidden_layers": 4, "num_local_experts": 32, "num_experts_per_tok": 8}
    shared = dict(base, architectures=["GraniteMoeSharedForCausalLM"], shared_intermediate_size=1024)
    assert resolve(shared, ep_size=4, ep_rank=1).decisions[Keys.NUM_LOCAL_EXPERTS].value == 8
    for kw in ({}, ENFORCE):
        assert_off(fusion(shared, **kw), "granitemoe_shared.structural.no_fused_layout", "shared MLP")
    assert_off(fusion(dict(shared, shared_intermediate_size=0)), "granitemoe_shared.no_shared_experts")
    assert_off(fusion(dict(base, architectures=["GraniteMoeForCausalLM"])), "granitemoe.no_shared_experts")
    swa = dict(shared, architectures=["GraniteMoeSWAForCausalLM"])
    for kw in ({}, ENFORCE):
        assert_off(fusion(swa, **kw), "granitemoe_swa.structural.no_fused_layout", "shared MLP")
    assert_off(fusion(dict(swa, shared_intermediate_size=0)), "granitemoe_swa.no_shared_experts")


# The hybrid families' expert fields as their published configs give them (and Cohere2-MoE's, whose shared experts
# also run beside the routed ones): (config, EP size, family, local experts a rank, the verdict fusion gets, enforced
# too, with what its reason names), and the config without a shared MLP where the family allows one.
HYBRIDS = [
    # Granite 4.0-H (granite-4.0-h-tiny's): its shared MLP (there by default) is never fused
    ({"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 40, "num_local_experts": 64,
      "num_experts_per_tok": 6, "layer_types": ["mamba"] * 40}, 8, "granitemoe_hybrid", 8,
     ("granitemoe_hybrid.structural.no_fused_layout", "shared MLP"), {"shared_intermediate_size": 0}),
    # Nemotron 3 Nano's: 128 ungated experts a MoE block, top-6, beside one shared MLP
    ({"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "MEMEM*E", "num_hidden_layers": 7,
      "n_routed_experts": 128, "num_experts_per_tok": 6, "n_shared_experts": 1}, 8, "nemotron_h", 16,
     ("nemotron_h.structural.no_fused_layout", "shared MLP"), None),
    # MiniMax-Text-01 / M1's: 32 experts, top-2, on every one of its 80 layers, no shared expert
    ({"architectures": ["MiniMaxForCausalLM"], "num_hidden_layers": 80, "num_local_experts": 32,
      "num_experts_per_tok": 2}, 8, "minimax", 4, ("minimax.no_shared_experts", "no shared experts"), None),
    # Kimi-Linear-48B-A3B's (its own names): 256 experts, top-8, one shared expert beside them
    ({"architectures": ["KimiLinearForCausalLM"], "num_hidden_layers": 27, "num_experts": 256,
      "num_experts_per_token": 8, "num_shared_experts": 1, "first_k_dense_replace": 1}, 8, "kimi_linear", 32,
     ("kimi_linear.structural.no_fused_layout", "1 shared expert(s)"), {"num_shared_experts": 0}),
    # Ling-3.0-Flash's (transformers' defaults): 512 experts, top-8, one shared expert beside them
    ({"architectures": ["BailingHybridForCausalLM"], "num_hidden_layers": 42}, 8, "bailing_hybrid", 64,
     ("bailing_hybrid.structural.no_fused_layout", "1 shared expert(s)"), {"num_shared_experts": 0}),
    # LongCat-Flash-Chat's: 512 routed experts (and 256 zero-computation ones, not placed), top-12, no shared expert
    ({"architectures": ["LongcatFlashForCausalLM"], "num_layers": 28, "n_routed_experts": 512, "zero_expert_num": 256,
      "moe_topk": 12}, 8, "longcat_flash", 64, ("longcat_flash.no_shared_experts", "no shared experts"), None),
    # Cohere2-MoE: 64 experts, top-8, one shared expert summed or averaged with them, 2 dense layers first
    ({"architectures": ["Cohere2MoeForCausalLM"], "num_hidden_layers": 40, "num_experts": 64, "num_experts_per_tok": 8,
      "num_shared_experts": 1, "first_k_dense_replace": 2}, 8, "cohere2_moe", 8,
     ("cohere2_moe.structural.no_fused_layout", "1 shared expert(s)"), {"num_shared_experts": 0}),
    # Step-3.5-Flash's (its config.json's older fields): 288 experts, top-8, the first 3 layers dense, one shared
    # expert; its lists cover its 3 MTP layers too
    ({"architectures": ["Step3p5ForCausalLM"], "num_hidden_layers": 45, "num_nextn_predict_layers": 3,
      "moe_num_experts": 288, "moe_top_k": 8, "moe_layers_enum": ",".join(str(i) for i in range(3, 48)),
      "share_expert_dim": 1280}, 8, "step3p5", 36, ("step3p5.structural.no_fused_layout", "shared expert"), None),
    # HY-V3's (transformers' defaults): 192 experts, top-8, one shared expert beside them, the first layer dense
    ({"architectures": ["HYV3ForCausalLM"], "num_hidden_layers": 80}, 8, "hy_v3", 24,
     ("hy_v3.structural.no_fused_layout", "1 shared expert(s)"), {"num_shared_experts": 0}),
    # Laguna's (transformers' defaults): 256 experts, top-8, one shared expert of its own width, the first layer dense
    ({"architectures": ["LagunaForCausalLM"], "num_hidden_layers": 40}, 8, "laguna", 32,
     ("laguna.structural.no_fused_layout", "shared expert"), None),
    # A.X K1's (transformers' defaults): 192 experts in 8 groups, top-8, one shared expert; not the fused architecture
    ({"architectures": ["AXK1ForCausalLM"], "num_hidden_layers": 61}, 8, "axk1", 24,
     ("deepseek.structural.architecture", "AXK1ForCausalLM is not the fused architecture"), {"n_shared_experts": 0}),
    # Flint's (transformers' defaults): 256 experts, top-6, an ungated shared expert, the first two layers dense
    ({"architectures": ["FlintForCausalLM"], "num_hidden_layers": 49}, 8, "flint", 32,
     ("flint.structural.no_fused_layout", "shared expert"), None),
    # Kolibri-1's (transformers' defaults): 384 experts, top-6 on every layer, an ungated shared expert
    ({"architectures": ["Kolibri1ForCausalLM"], "num_hidden_layers": 50}, 8, "kolibri1", 48,
     ("kolibri1.structural.no_fused_layout", "shared expert"), None),
    # Mellum's (transformers' defaults): 64 experts, top-8 on every layer, no shared expert
    ({"architectures": ["MellumForCausalLM"], "num_hidden_layers": 28}, 8, "mellum", 8,
     ("mellum.no_shared_experts", "no shared experts"), None),
    # Mistral 4's (transformers' defaults): 128 experts, top-4, one shared expert, every layer MoE; not the fused
    # architecture
    ({"architectures": ["Mistral4ForCausalLM"], "num_hidden_layers": 36}, 8, "mistral4", 16,
     ("deepseek.structural.architecture", "Mistral4ForCausalLM is not the fused architecture"),
     {"n_shared_experts": 0}),
    # sarvam-105b's and sarvam-30b's (Sarvam's names, the defaults they leave out): DeepSeek-V3's and GLM-4-MoE's
    # blocks, 128 experts and one shared one, not the fused architectures
    ({"architectures": ["SarvamMLAForCausalLM"], "num_hidden_layers": 32, "num_experts": 128,
      "num_shared_experts": 1}, 8, "sarvam_mla", 16,
     ("deepseek.structural.architecture", "SarvamMLAForCausalLM is not the fused architecture"),
     {"num_shared_experts": 0}),
    ({"architectures": ["SarvamMoEForCausalLM"], "num_hidden_layers": 19, "num_experts": 128}, 4, "sarvam_moe", 32,
     ("glm4_moe.structural.architecture", "SarvamMoEForCausalLM is not the fused architecture"),
     {"num_shared_experts": 0}),
    # Jamba 1.5 Mini's: 16 experts, top-2, no shared expert
    ({"architectures": ["JambaForCausalLM"], "num_hidden_layers": 32, "num_experts": 16, "num_experts_per_tok": 2},
     4, "jamba", 4, ("jamba.no_shared_experts", "no shared experts"), None),
]


@pytest.mark.parametrize("cfg, ep_size, family, local, verdict, unshared", HYBRIDS, ids=[h[2] for h in HYBRIDS])
def test_the_hybrid_families_never_fuse(cfg, ep_size, family, local, verdict, unshared):
    """Their experts split by EP rank as any family's; a shared MLP beside them is never fused (structural: enforce
    does not lift it), and without one the plan says so."""
    res = resolve(cfg, ep_size=ep_size, ep_rank=ep_size - 1)
    assert res.family == family and res.decisions[Keys.NUM_LOCAL_EXPERTS].value == local
    for kw in ({}, ENFORCE):
        assert_off(fusion(cfg, **kw), *verdict)
    if unshared is not None:
        assert_off(fusion(dict(cfg, **unshared)), f"{family}.no_shared_experts")


# The fields of tencent/Hunyuan-A13B-Instruct's config.json that the rules read, as it writes them (per layer).
HUNYUAN_A13B = {"architectures": ["HunYuanMoEV1ForCausalLM"], "num_hidden_layers": 32, "num_experts": 64,
                "moe_topk": [8] * 32, "num_shared_expert": [1] * 32, "intermediate_size": 3072,
                "moe_intermediate_size": [3072] * 32, "use_mixed_mlp_moe": True}


def test_hunyuan_is_its_own_family_and_its_shared_mlp_never_fused():
    """Hunyuan-A13B: 64 experts on every layer, top-8 and one shared MLP as its config writes them (per layer); the
    shared MLP has no fused layout (structural, so enforce does not lift it)."""
    res = resolve(HUNYUAN_A13B, ep_size=8, ep_rank=5)
    assert res.family == "hunyuan_v1_moe" and res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 8
    for kw in ({}, ENFORCE):
        assert_off(fusion(HUNYUAN_A13B, **kw), "hunyuan_v1_moe.structural.no_fused_layout", "shared MLP")


def test_afmoe_is_its_own_family_and_never_fused():
    """AFMoE (Trinity): every layer from num_dense_layers MoE, with num_shared_experts beside the routed ones, which
    have no fused layout (structural, so enforce does not lift it)."""
    cfg = {"architectures": ["AfmoeForCausalLM"], "num_hidden_layers": 8, "num_experts": 128, "num_experts_per_tok": 8,
           "num_shared_experts": 1, "num_dense_layers": 2}
    res = resolve(cfg, ep_size=4, ep_rank=1)
    assert res.family == "afmoe" and res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 32
    for kw in ({}, ENFORCE):
        assert_off(fusion(cfg, **kw), "afmoe.structural.no_fused_layout", "1 shared expert(s)")
    assert_off(fusion(dict(cfg, num_shared_experts=0)), "afmoe.no_shared_experts")


def test_exaone_moe_is_its_own_family_and_never_fused():
    """EXAONE-MoE: DeepSeek-V3's MoE block under its own names (num_experts, num_shared_experts, mlp_layer_types);
    its shared expert has no fused layout (structural, so enforce does not lift it)."""
    cfg = {"architectures": ["ExaoneMoeForCausalLM"], "num_hidden_layers": 6, "num_experts": 128,
           "num_experts_per_tok": 8, "num_shared_experts": 1, "mlp_layer_types": ["dense"] + ["sparse"] * 5}
    res = resolve(cfg, ep_size=8, ep_rank=7)
    assert res.family == "exaone_moe" and res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 16
    for kw in ({}, ENFORCE):
        assert_off(fusion(cfg, **kw), "exaone_moe.structural.no_fused_layout", "1 shared expert(s)")
    assert_off(fusion(dict(cfg, num_shared_experts=0)), "exaone_moe.no_shared_experts")


def test_solar_open_is_its_own_family_and_never_fused():
    """Solar Open (Solar-Open-100B's fields, the defaults it leaves out): GLM-4-MoE's MoE block on every layer, 128
    experts, top-8, one shared expert beside them with no fused layout (structural, so enforce does not lift it)."""
    cfg = {"architectures": ["SolarOpenForCausalLM"], "num_hidden_layers": 48}
    res = resolve(cfg, ep_size=8, ep_rank=3)
    assert res.family == "solar_open" and res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 16
    for kw in ({}, ENFORCE):
        assert_off(fusion(cfg, **kw), "solar_open.structural.no_fused_layout", "1 shared expert(s)")
    assert_off(fusion(dict(cfg, n_shared_experts=0)), "solar_open.no_shared_experts")


def test_mimo_v2_flash_has_no_shared_experts_and_a_dense_first_layer():
    cfg = {"architectures": ["MiMoV2FlashForCausalLM"], "num_hidden_layers": 48, "n_routed_experts": 256,
           "num_experts_per_tok": 8}
    res = resolve(cfg, ep_size=16, ep_rank=15)
    assert res.family == "mimo_v2_flash" and res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 16
    assert_off(fusion(cfg), "mimo_v2_flash.no_shared_experts")


def test_dbrx_reads_its_experts_from_ffn_config_and_has_no_shared_ones():
    """DBRX (dbrx-instruct's shape): 16 experts, 4 a token, on each of 40 layers, under ffn_config."""
    cfg = {"architectures": ["DbrxForCausalLM"], "n_layers": 40,
           "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4, "ffn_hidden_size": 10752}}
    res = resolve(cfg, ep_size=8, ep_rank=6)
    assert res.family == "dbrx" and res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 2
    assert_off(fusion(cfg), "dbrx.no_shared_experts")


def test_lfm2_moe_has_no_shared_experts_and_dense_first_layers():
    cfg = {"architectures": ["Lfm2MoeForCausalLM"], "num_hidden_layers": 24, "num_experts": 32,
           "num_experts_per_tok": 4, "num_dense_layers": 2}
    res = resolve(cfg, ep_size=8, ep_rank=3)
    assert res.family == "lfm2_moe" and res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 4
    assert_off(fusion(cfg), "lfm2_moe.no_shared_experts")


def test_flex_olmo_has_no_shared_experts():
    cfg = {"architectures": ["FlexOlmoForCausalLM"], "num_hidden_layers": 32, "num_experts": 7,
           "num_experts_per_tok": 7}
    res = resolve(cfg, ep_size=1, ep_rank=0)
    assert res.family == "flex_olmo" and res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 7
    assert_off(fusion(cfg), "flex_olmo.no_shared_experts")


@pytest.mark.parametrize("arch", ["PhiMoEForCausalLM", "PhimoeForCausalLM"])
def test_phimoe_in_either_spelling_has_no_shared_experts(arch):
    """Phi-3.5-MoE: 16 experts on every layer, two a token; the Hub's spelling and transformers' plan alike."""
    cfg = {"architectures": [arch], "num_hidden_layers": 32, "num_local_experts": 16, "num_experts_per_tok": 2}
    res = resolve(cfg, ep_size=4, ep_rank=3)
    assert res.family == "phimoe" and res.decisions[Keys.NUM_LOCAL_EXPERTS].value == 4
    assert_off(fusion(cfg), "phimoe.no_shared_experts")


def test_glm5_is_the_deepseek_gate_with_its_own_fused_architecture():
    """GLM-5 (V3.2's model): fused where DeepSeek-V3 would be (SGLang's GlmMoeDsaForCausalLM fix); the structural
    conditions still hold (e.g. 256 experts)."""
    cfg = dict(deepseek(), architectures=["GlmMoeDsaForCausalLM"], index_topk=2048, index_n_heads=32,
               index_head_dim=128)
    res = resolve(cfg, ep_size=8, ep_rank=5)
    assert res.family == "deepseek"
    assert_fused(res.decisions[Keys.SHARED_EXPERTS_FUSION], "deepseek")
    assert_off(fusion(dict(cfg, n_routed_experts=160), **ENFORCE), "deepseek.structural.n_routed_experts",
               "n_routed_experts=160")


# --- families that never fuse: a row of the table, not a gate ----------------------

def test_never_fusing_families_are_rows_with_their_reason_and_enforce_does_not_skip_them():
    rows = {name: fam for name, fam in entries.FAMILIES.items() if fam.never_fuses is not None}
    assert len(rows) == 19 and all(fam.gate is None and fam.has_shared_experts for fam in rows.values())
    cfg = {"architectures": ["AfmoeForCausalLM"], "num_hidden_layers": 3, "num_experts": 8,
           "num_experts_per_tok": 2, "num_shared_experts": 2, "num_dense_layers": 1}
    for kw in ({}, ENFORCE):
        assert_off(fusion(cfg, **kw), "afmoe.structural.no_fused_layout",
                   "its 2 shared expert(s) run beside the routed experts", "AFMoE")
