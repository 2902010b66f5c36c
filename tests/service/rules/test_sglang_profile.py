"""The sglang profile (service/rules/sglang.py): SGLang 0.5.23's rewrites, refusals, gates, forward and tiling.

The whole grid is checked against SGLang's own recorded answers by tests/conformance; these tests pin each rule
on a real config, with SGLang's reason where SGLang gives one.
"""

from __future__ import annotations

import pytest

from loadplan.plan import Keys
from loadplan.errors import FailedPrecondition, NotFound
from loadplan.service.rules import entries, sglang
from loadplan.config_view import ConfigView

from ._fixtures import real_request
from loadplan.service.rules.resolve import resolve_decisions


def decide(name: str, **kw):
    kw.setdefault("engine", "sglang")
    kw.setdefault("device", "cuda:9.0")
    return resolve_decisions(real_request(name, **kw)).decisions


def value(d, key):
    return d[key].value


def test_deepseek_v3_fuses_on_hopper_without_ep_and_says_the_profile():
    d = decide("deepseek-v3", tp_size=8)
    assert value(d, Keys.ENGINE_PROFILE) == "sglang 0.5.23"
    assert value(d, Keys.SHARED_EXPERTS_FUSION) is True and value(d, Keys.NUM_FUSED_SHARED_EXPERTS) == 1
    assert (value(d, Keys.FORWARD_PATH), value(d, Keys.POST_EXPERTS_ALL_REDUCE)) == ("normal", True)


def test_sm100_auto_runner_is_flashinfer_trtllm_which_turns_fusion_off_and_is_recorded():
    d = decide("deepseek-v3", tp_size=8, device="cuda:10.0")
    assert value(d, "sglang.moe_runner_backend") == "flashinfer_trtllm"
    assert "sm100" in d["sglang.moe_runner_backend"].reason
    assert value(d, "sglang.disable_shared_experts_fusion") is True
    assert value(d, Keys.SHARED_EXPERTS_FUSION) is False


def test_an_a2a_backend_forces_ep_to_the_tp_group_with_sglangs_reason():
    d = decide("deepseek-v3", tp_size=2, ep_size=4, a2a_backend="deepep")
    assert value(d, "sglang.ep_size") == 8 and "adjusted from 4 to the tensor parallel size [8]" in \
        d["sglang.ep_size"].reason
    assert value(d, Keys.NUM_LOCAL_EXPERTS) == 32
    assert value(d, Keys.SHARED_EXPERTS_FUSION) is False            # DeepEP-class: off unless enforced
    assert (value(d, Keys.FORWARD_PATH), value(d, Keys.POST_EXPERTS_ALL_REDUCE)) == ("a2a", False)


def test_ascend_tp_is_rewritten_to_none():
    d = decide("deepseek-v3", tp_size=8, a2a_backend="ascend_tp")
    assert value(d, "sglang.moe_a2a_backend") == "none" and value(d, Keys.FORWARD_PATH) == "normal"


def test_flashinfer_a2a_forces_fusion_off_and_needs_attention_dp_equal_to_tp():
    with pytest.raises(FailedPrecondition, match=r"^runtime\.a2a_backend: SGLang 0\.5\.23 refuses to start: "
                                                 r"Flashinfer MoE A2A requires --attn-dp-size"):
        decide("deepseek-v3", tp_size=8, a2a_backend="flashinfer")
    d = decide("deepseek-v3", tp_size=1, ep_size=8, dp_size=8, a2a_backend="flashinfer",
               moe_runner_backend="flashinfer_cutlass")
    assert value(d, "sglang.disable_shared_experts_fusion") is True
    assert (value(d, Keys.FORWARD_PATH), value(d, Keys.POST_EXPERTS_ALL_REDUCE)) == ("a2a", False)


@pytest.mark.parametrize("kw,flag", [
    (dict(enable_sbo=True), "runtime.enable_sbo"),                                   # SBO on SM90
    (dict(a2a_backend="pplx"), "runtime.a2a_backend"),                               # pplx without attention DP
    (dict(a2a_backend="megamoe", enable_tbo=True), "runtime.enable_tbo"),
    (dict(a2a_backend="deepep_v2", enforce_shared_experts_fusion=True), "runtime.enforce_shared_experts_fusion"),
])
def test_start_up_refusals_name_the_flag(kw, flag):
    with pytest.raises(FailedPrecondition) as e:
        decide("deepseek-v3", tp_size=8, **kw)
    assert str(e.value).startswith(f"{flag}: SGLang 0.5.23 refuses to start: ")


def test_deepep_v2_refuses_architectures_not_registered_for_it():
    with pytest.raises(FailedPrecondition, match="DeepEP v2 MoE is not validated for 'Glm4MoeForCausalLM'"):
        decide("glm-4.5", tp_size=8, a2a_backend="deepep_v2")


def test_qwen2_moe_never_fuses_in_sglang():
    d = decide("qwen1.5-moe-a2.7b", tp_size=8, enforce_shared_experts_fusion=True)
    assert value(d, Keys.SHARED_EXPERTS_FUSION) is False and d[Keys.SHARED_EXPERTS_FUSION].rule == "sglang.no_gate"


def test_glm45_gate_reads_neither_enforce_nor_overlap():
    assert value(decide("glm-4.5", tp_size=8, enable_tbo=True), Keys.SHARED_EXPERTS_FUSION) is True
    d = decide("glm-4.5", tp_size=2, ep_size=4, enforce_shared_experts_fusion=True)
    assert value(d, Keys.SHARED_EXPERTS_FUSION) is False and "expert parallelism" in d[Keys.SHARED_EXPERTS_FUSION].reason
    assert value(decide("glm-4.5", tp_size=2, ep_size=4, device="hip:9.4"), Keys.SHARED_EXPERTS_FUSION) is True


def test_deepseek_gate_under_enforce_skips_everything_but_the_quantization_veto():
    d = decide("deepseek-v3", tp_size=8, enable_tbo=True, enforce_shared_experts_fusion=True)
    assert value(d, Keys.SHARED_EXPERTS_FUSION) is True
    d = decide("deepseek-v3", tp_size=8, enable_tbo=True)
    assert d[Keys.SHARED_EXPERTS_FUSION].reason.startswith("SBO/TBO enabled")


def test_pipeline_stages_put_the_leftover_layers_last():
    ranges = [resolve_decisions(real_request("deepseek-v3", engine="sglang", device="cuda:9.0", tp_size=8,
                                             pp_size=4, pp_rank=r)).decisions[Keys.PP_LAYER_RANGE].value
              for r in range(4)]
    assert ranges == [[0, 15], [15, 30], [30, 45], [45, 61]]      # 61 = 4 * 15 + 1: the last stage takes it
    assert sglang.stage_range(10, 3, 0) == (0, 3) and sglang.stage_range(10, 3, 2) == (6, 10)


def test_a_draft_gets_no_eplb():
    kw = dict(tp_size=1, ep_size=8, enable_eplb=True)
    assert value(decide("deepseek-v3", **kw), Keys.EPLB_ENABLED) is True
    d = decide("deepseek-v3", role="speculative", **kw)
    assert value(d, Keys.EPLB_ENABLED) is False and "draft worker" in d[Keys.EPLB_ENABLED].reason


@pytest.mark.parametrize("name,kw,hazard", [
    ("deepseek-v3", dict(tp_size=8, a2a_backend="nixl", enforce_shared_experts_fusion=True),
     "sglang.fused_global_slot_on_dispatch"),
    ("kimi-k2", dict(tp_size=8, enforce_shared_experts_fusion=True), "sglang.enforced_384_without_quark"),
    ("qwen3-30b-a3b", dict(tp_size=2, ep_size=4, a2a_backend="nixl"), "sglang.double_reduction"),
])
def test_hazards_refuse_naming_the_code_path_and_a_safe_alternative(name, kw, hazard):
    with pytest.raises(FailedPrecondition) as e:
        decide(name, **kw)
    text = str(e.value)
    assert text.startswith(f"hazard: {hazard}: ") and "sglang/srt/models/" in text and "safe alternative: " in text


def test_unknown_backend_and_runner_are_not_found_listing_sglangs():
    with pytest.raises(NotFound) as e:
        decide("deepseek-v3", a2a_backend="deepep_v3")
    assert "pplx" in e.value.known and e.value.field == "runtime.a2a_backend"
    with pytest.raises(NotFound) as e:
        decide("deepseek-v3", moe_runner_backend="cuda_magic")
    assert e.value.field == "runtime.moe_runner_backend"


def test_rules_only_wrappers_into_deepseek_v2_ask_its_gate_with_what_they_hand_down():
    """KimiVL, DotsVLM and DeepseekVL2 are rules only (loadplan's engine does not build them): SGLang asks
    DeepSeek-V2's gate with their text model's config, which never names the fused architecture."""
    from loadplan.service.coverage import coverage_of

    from ._fixtures import deepseek, resolve
    for name, field in (("KimiVLForConditionalGeneration", "text_config"), ("DotsVLMForCausalLM", "language_config"),
                        ("DeepseekVL2ForCausalLM", "language_config")):
        cov = coverage_of(name)
        assert cov.ok and cov.message.endswith("rules only (loadplan's engine does not build it)")
        inner = deepseek()
        if name != "KimiVLForConditionalGeneration":     # KimiVL renames it; the others' nested configs name none
            del inner["architectures"]
        cfg = {"architectures": [name], field: inner}
        res = resolve(cfg, engine="sglang", device="cuda:9.0", tp_size=8)
        assert res.chain == (name, "DeepseekV2ForCausalLM")
        d = res.decisions[Keys.SHARED_EXPERTS_FUSION]
        assert d.value is False and d.reason == "Config does not support fused shared expert(s)."
        enforced = resolve(cfg, engine="sglang", device="cuda:9.0", tp_size=8, enforce_shared_experts_fusion=True)
        assert enforced.decisions[Keys.SHARED_EXPERTS_FUSION].value is True     # SGLang: enforce allows it


def test_quark_excluding_the_shared_expert_vetoes_fusion_even_when_enforced():
    from ._fixtures import deepseek, resolve
    q = {"quant_method": "quark", "exclude": ["model.layers.3.mlp.shared_experts.gate_up_proj"]}
    for kw in ({}, {"enforce_shared_experts_fusion": True}):
        d = resolve(deepseek(), engine="sglang", device="cuda:9.0", quantization_config=q, **kw).decisions
        assert d[Keys.SHARED_EXPERTS_FUSION].value is False
        assert d[Keys.SHARED_EXPERTS_FUSION].reason.startswith("Quantization keeps shared experts at a higher precision")
    q_all = {"quant_method": "quark", "exclude": ["lm_head"]}
    assert resolve(deepseek(), engine="sglang", device="cuda:9.0",
                   quantization_config=q_all).decisions[Keys.SHARED_EXPERTS_FUSION].value is True


def test_a_compressed_tensors_w4a16_scheme_is_read_as_sglang_reads_it():
    from ._fixtures import deepseek, resolve
    q = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
        "input_activations": None}}}
    d = resolve(deepseek(), engine="sglang", device="cuda:9.0", quantization_config=q).decisions
    assert d[Keys.SHARED_EXPERTS_FUSION].value is False and "W4AFP8/W4A16" in d[Keys.SHARED_EXPERTS_FUSION].reason


def test_glm47_flash_and_its_nextn_draft_have_sglangs_gate():
    from ._fixtures import resolve
    body = {"num_hidden_layers": 4, "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 4,
            "first_k_dense_replace": 1}
    target = {"architectures": ["Glm4MoeLiteForCausalLM"], **body}
    draft = {"architectures": ["Glm4MoeLiteForCausalLMNextN"], "num_nextn_predict_layers": 1, **body}
    for cfg in (target, draft):
        assert resolve(cfg, engine="sglang", device="cuda:9.0", tp_size=8).decisions[
            Keys.SHARED_EXPERTS_FUSION].value is True
        off = resolve(cfg, engine="sglang", device="hip:9.4", tp_size=8).decisions[Keys.SHARED_EXPERTS_FUSION]
        assert off.value is False and off.reason.startswith("Only GLM-4.5 or GLM-4.6 on NV-platform")
        ep = resolve(cfg, engine="sglang", device="cuda:9.0", tp_size=2, ep_size=4).decisions[
            Keys.SHARED_EXPERTS_FUSION]
        assert ep.value is False and "under expert parallelism" in ep.reason
    assert resolve(draft, engine="sglang", device="cuda:9.0").decisions[Keys.PP_LAYER_RANGE].value == [4, 5]


# --- MoE layers SGLang places otherwise than transformers (SGLANG_MOE_LAYERS) ---------------------------------------

KIMI = {"architectures": ["KimiLinearForCausalLM"], "num_hidden_layers": 4, "num_experts": 8, "num_shared_experts": 1,
        "num_experts_per_token": 2, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}
MIMO = {"architectures": ["MiMoV2FlashForCausalLM"], "num_hidden_layers": 4, "n_routed_experts": 8,
        "num_experts_per_tok": 2}
COHERE2 = {"architectures": ["Cohere2MoeForCausalLM"], "num_hidden_layers": 4, "num_experts": 8,
           "num_experts_per_tok": 2, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}
GLM47_FLASH = {"architectures": ["Glm4MoeLiteForCausalLM"], "num_hidden_layers": 4, "n_routed_experts": 64}
QWEN3 = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2}
LLAMA4 = {"architectures": ["Llama4ForCausalLM"], "num_hidden_layers": 4, "num_local_experts": 8}
EXAONE = {"architectures": ["ExaoneMoeForCausalLM"], "num_hidden_layers": 4, "num_experts": 8,
          "first_k_dense_replace": 1}
ERNIE = {"architectures": ["Ernie4_5_MoeForCausalLM"], "num_hidden_layers": 6, "moe_num_experts": 8, "moe_k": 2,
         "moe_layer_start_index": 0}


@pytest.mark.parametrize("cfg,field,agreeing", [
    # SGLang: every layer from first_k_dense_replace (0 without it); transformers: mlp_layer_types
    (KIMI, "first_k_dense_replace", {"first_k_dense_replace": 1}),
    (dict(KIMI, first_k_dense_replace=1, moe_layer_freq=2), "moe_layer_freq", {"moe_layer_freq": 1}),
    (COHERE2, "first_k_dense_replace", {"first_k_dense_replace": 1}),
    # SGLang: its per-layer flags (no MoE layer without them); transformers: mlp_layer_types
    (MIMO, "moe_layer_freq", {"moe_layer_freq": [0, 1, 1, 1]}),
    (dict(MIMO, moe_layer_freq=[0, 0, 1, 1]), "moe_layer_freq", {"moe_layer_freq": [0, 1, 1, 1]}),
    (EXAONE, "is_moe_layer", {"is_moe_layer": [False, True, True, True]}),
    # SGLang cannot load GLM-4.7-Flash without first_k_dense_replace
    (GLM47_FLASH, "first_k_dense_replace", {"first_k_dense_replace": 1}),
    (dict(GLM47_FLASH, first_k_dense_replace=2), "first_k_dense_replace", {"first_k_dense_replace": 1}),
    # SGLang's Qwen MoE models make every layer MoE; transformers reads decoder_sparse_step and mlp_only_layers
    (dict(QWEN3, decoder_sparse_step=2, mlp_only_layers=[]), "decoder_sparse_step", {"decoder_sparse_step": 1}),
    (dict(QWEN3, decoder_sparse_step=1, mlp_only_layers=[0]), "mlp_only_layers", {"mlp_only_layers": []}),
    # SGLang: interleave_moe_layer_step alone; transformers: moe_layers where given
    (dict(LLAMA4, moe_layers=[0, 2]), "moe_layers", {"moe_layers": [0, 1, 2, 3]}),
    # SGLang counts moe_layer_interval from moe_layer_start_index, transformers from layer 0
    (dict(ERNIE, moe_layer_interval=2), "moe_layer_interval", {"moe_layer_interval": 1}),
])
def test_moe_layers_sglang_places_otherwise_than_the_plan_are_refused_for_sglang_alone(cfg, field, agreeing):
    from ._fixtures import resolve
    from loadplan.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as e:
        resolve(cfg, engine="sglang", device="cuda:9.0")
    assert e.value.field == f"config.{field}" and "SGLang places" in str(e.value)
    assert resolve(cfg).decisions[Keys.EPLB_LAYERS] is not None          # transformers' reading, for loadplan
    res = resolve(dict(cfg, **agreeing), engine="sglang", device="cuda:9.0", enable_eplb=True)
    placement = sglang.SGLANG_MOE_LAYERS[entries.ENTRY_CLASSES[cfg["architectures"][0]].family]
    assert res.decisions[Keys.EPLB_LAYERS].value == list(placement.place(ConfigView(dict(cfg, **agreeing)),
                                                                         cfg["num_hidden_layers"]))


def test_a_kimi_linear_config_sglang_reads_alike_without_the_field_is_planned():
    from ._fixtures import resolve

    every = dict(KIMI, mlp_layer_types=["sparse"] * 4)       # SGLang's default first_k_dense_replace (0) agrees
    assert resolve(every, engine="sglang", device="cuda:9.0", enable_eplb=True).decisions[
        Keys.EPLB_LAYERS].value == [0, 1, 2, 3]


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLMNextN", "Glm4MoeForCausalLMNextN"])
@pytest.mark.parametrize("count", [0, 2])
def test_a_nextn_draft_of_other_than_one_mtp_layer_is_refused_for_sglang_in_its_words(arch, count):
    """SGLang's NextN weight loader asserts one MTP layer before it reads a tensor ("Only 1 nextn layer is
    supported"): a checkpoint shipping none (Kimi-K2) or several is refused at load."""
    from ._fixtures import deepseek, resolve

    cfg = dict(deepseek(), architectures=[arch], num_nextn_predict_layers=count)
    with pytest.raises(FailedPrecondition, match=r"^config\.num_nextn_predict_layers: .*Only 1 nextn layer is "
                                                 r"supported") as e:
        resolve(cfg, engine="sglang", device="cuda:9.0")
    assert e.value.field == "config.num_nextn_predict_layers"
    if count == 2:
        assert resolve(cfg).decisions[Keys.PP_LAYER_RANGE].value == [4, 6]    # loadplan's engine builds both


@pytest.mark.parametrize("cfg,field", [
    # Step3p5Config reads moe_num_experts / moe_top_k alone (defaults 288 / 8), transformers its own names
    ({"architectures": ["Step3p5ForCausalLM"], "num_hidden_layers": 4, "moe_layers_enum": "1,2,3",
      "n_routed_experts": 64, "num_experts_per_tok": 8}, "moe_num_experts"),
    ({"architectures": ["Step3p5ForCausalLM"], "num_hidden_layers": 4, "moe_layers_enum": "1,2,3",
      "n_routed_experts": 288, "num_experts_per_tok": 4}, "moe_top_k"),
    # SGLang's PhiMoE router asserts top-2
    ({"architectures": ["PhiMoEForCausalLM"], "num_hidden_layers": 4, "num_local_experts": 16,
      "num_experts_per_tok": 4}, "num_experts_per_tok"),
])
def test_expert_counts_sglang_builds_otherwise_than_the_plan_are_refused_for_sglang_alone(cfg, field):
    from ._fixtures import resolve
    from loadplan.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as e:
        resolve(cfg, engine="sglang", device="cuda:9.0")
    assert e.value.field == f"config.{field}" and "SGLang" in str(e.value)
    resolve(cfg)                                                   # transformers' reading, for loadplan
    agreeing = {"moe_num_experts": cfg.get("n_routed_experts"), "moe_top_k": cfg["num_experts_per_tok"]} \
        if field.startswith("moe_") else {"num_experts_per_tok": 2}
    resolve(dict(cfg, **agreeing), engine="sglang", device="cuda:9.0")
