"""The rules-only entries SGLang 0.5.23 gates beyond loadplan's engine (DESIGN 8.1, issue 30): MiniMax-M3,
DeepSeek-V4, Dots3, DeepseekOCR, Pixtral (-> MistralLarge3), MiniCPM-V 4.6/4.7. Each: its delegation chain, its
fusion answer under engine sglang on cuda:9.0 (SGLang's own gate, as models/*.py states it), enforced vs not where
the gate reads enforce, and `loadplan coverage` calling it rules only."""

from __future__ import annotations

import pytest

from loadplan.plan import Keys
from loadplan.service.coverage import coverage_of
from loadplan.errors import FailedPrecondition, InvalidArgument
from loadplan.config_view import ConfigView
from loadplan.layouts import minimax_m3_layout

from ._fixtures import deepseek, resolve

RULES_ONLY = ("MiniMaxM3SparseForCausalLM", "DeepseekV4ForCausalLM", "Dots3NoteForCausalLM", "MistralLarge3ForCausalLM",
              "PixtralForConditionalGeneration", "DeepseekOCRForCausalLM", "MiniCPMV4_6ForConditionalGeneration",
              "MiniCPMV4_7ForConditionalGeneration")


def minimax_m3(**over):
    cfg = {"architectures": ["MiniMaxM3SparseForCausalLM"], "num_hidden_layers": 4, "num_local_experts": 128,
           "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_layer_freq": [0, 1, 1, 1]}
    cfg.update(over)
    return cfg


def sglang(cfg, **kw):
    kw.setdefault("device", "cuda:9.0")
    return resolve(cfg, engine="sglang", **kw)


def fused(cfg, **kw):
    return sglang(cfg, **kw).decisions[Keys.SHARED_EXPERTS_FUSION]


@pytest.mark.parametrize("name", RULES_ONLY)
def test_coverage_calls_each_new_entry_rules_only(name):
    cov = coverage_of(name)
    assert cov.ok, cov.message
    assert cov.message.endswith("rules only (loadplan's engine does not build it)")


def test_minimax_m3_fuses_on_sm90_without_ep_and_not_with_ep_or_deepep():
    res = sglang(minimax_m3(), tp_size=8)
    assert res.chain == ("MiniMaxM3SparseForCausalLM",)
    assert res.decisions[Keys.SHARED_EXPERTS_FUSION].value is True
    d = fused(minimax_m3(), tp_size=2, ep_size=4)
    assert d.value is False and d.reason == "Shared experts fusion is not supported together with expert parallelism yet."
    d = fused(minimax_m3(), tp_size=8, device="cuda:7.5")
    assert d.value is False and d.reason == "Shared experts fusion requires SM80 or newer GPUs."
    d = fused(minimax_m3(n_shared_experts=0), tp_size=8)
    assert d.value is False and d.reason == "No shared experts are defined in the config."
    d = fused(minimax_m3(), tp_size=8, quantization_config={"quant_method": "modelopt_mixed"})
    assert d.value is False and d.reason.startswith("Shared and routed experts may use different quantization")
    # its gate reads no enforce: enforcing does not lift the EP veto
    assert fused(minimax_m3(), tp_size=2, ep_size=4, enforce_shared_experts_fusion=True).value is False


def test_minimax_m3_layout_reads_moe_layer_freq_per_layer():
    assert minimax_m3_layout(ConfigView(minimax_m3())).moe_layers == (1, 2, 3)      # its non-zero entries
    assert minimax_m3_layout(ConfigView(minimax_m3(moe_layer_freq=None))).moe_layers == (0, 1, 2, 3)
    with pytest.raises(InvalidArgument) as e:
        minimax_m3_layout(ConfigView(minimax_m3(moe_layer_freq=[1, 1])))
    assert e.value.field == "config.moe_layer_freq"


def test_minimax_m3_with_two_shared_experts_is_refused_where_sglang_asserts_one():
    with pytest.raises(FailedPrecondition, match="Only 1 fused shared expert is supported for MiniMax-M3"):
        sglang(minimax_m3(n_shared_experts=2), tp_size=8)


def test_deepseek_v4_fuses_only_when_enforced():
    cfg = deepseek(architectures=["DeepseekV4ForCausalLM"])
    res = sglang(cfg, tp_size=8)
    assert res.chain == ("DeepseekV4ForCausalLM",)
    d = res.decisions[Keys.SHARED_EXPERTS_FUSION]
    assert d.value is False and d.reason == "Config does not support fused shared expert(s)."
    assert fused(cfg, tp_size=8, enforce_shared_experts_fusion=True).value is True
    # EP without per-rank shared slots vetoes even when enforced
    d = fused(cfg, tp_size=2, ep_size=4, enforce_shared_experts_fusion=True)
    assert d.value is False and d.reason.startswith("Expert parallelism keeps only a slice of the routed experts")
    with pytest.raises(FailedPrecondition, match="expects exactly one shared expert"):
        sglang(deepseek(architectures=["DeepseekV4ForCausalLM"], n_shared_experts=2), tp_size=8,
               enforce_shared_experts_fusion=True)


def test_dots3_fuses_as_its_own_architecture_with_256_experts_and_one_shared():
    cfg = deepseek(architectures=["Dots3NoteForCausalLM"])
    res = sglang(cfg, tp_size=8)
    assert res.chain == ("Dots3NoteForCausalLM",)
    assert res.decisions[Keys.SHARED_EXPERTS_FUSION].value is True       # no enforce needed
    d = fused(deepseek(architectures=["Dots3NoteForCausalLM"], n_routed_experts=128), tp_size=8)
    assert d.value is False and d.reason == "Shared-expert fusion is unsupported for this Dots3 configuration."
    d = fused(cfg, tp_size=2, ep_size=4)
    assert d.value is False and d.reason == "Dots3 shared-expert fusion is unsupported with expert parallelism."
    # its gate reads no enforce
    assert fused(cfg, tp_size=2, ep_size=4, enforce_shared_experts_fusion=True).value is False


def _pixtral(model_type="deepseek_v3"):
    text = deepseek(model_type=model_type)
    del text["architectures"]
    return {"architectures": ["PixtralForConditionalGeneration"], "text_config": text}


def test_pixtral_with_a_deepseek_v3_text_config_asks_the_deepseek_gate_via_mistral_large_3():
    res = sglang(_pixtral(), tp_size=8)
    assert res.chain == ("PixtralForConditionalGeneration", "MistralLarge3ForCausalLM")
    d = res.decisions[Keys.SHARED_EXPERTS_FUSION]
    # its text config names no DeepseekV3ForCausalLM architecture: the DeepSeek gate's structural "no" ...
    assert d.value is False and d.reason == "Config does not support fused shared expert(s)."
    # ... which enforce lifts, as for DeepSeek
    assert fused(_pixtral(), tp_size=8, enforce_shared_experts_fusion=True).value is True
    # SBO/TBO veto before the structural check: the DeepSeek gate's order
    assert fused(_pixtral(), tp_size=8, enable_tbo=True).reason.startswith("SBO/TBO enabled")


def test_pixtral_with_another_text_model_type_never_fuses_even_when_enforced():
    d = fused(_pixtral("mistral"), tp_size=8, enforce_shared_experts_fusion=True)
    assert d.value is False and "text_config.model_type == 'deepseek_v3'" in d.reason


def _ocr(**text_over):
    text = deepseek(**text_over)
    del text["architectures"]
    # config.json's language_config (SGLang's DeepseekVLV2Config makes it hf_config.text_config)
    return {"architectures": ["DeepseekOCRForCausalLM"], "language_config": text}


def test_deepseek_ocr_asks_deepseek_v2s_gate_with_its_language_config_when_noaux_tc_or_mla():
    res = sglang(_ocr(topk_method="noaux_tc"), tp_size=8)
    assert res.chain == ("DeepseekOCRForCausalLM", "DeepseekV2ForCausalLM")
    assert res.decisions[Keys.SHARED_EXPERTS_FUSION].reason == "Config does not support fused shared expert(s)."
    assert fused(_ocr(topk_method="noaux_tc"), tp_size=8, enforce_shared_experts_fusion=True).value is True
    assert fused(_ocr(use_mla=True), tp_size=8, enforce_shared_experts_fusion=True).value is True
    # neither noaux_tc nor MLA (the OCR v1 language model's branch): the hooks answer None and 0, never fused
    d = fused(_ocr(topk_method="greedy", use_mla=False), tp_size=8, enforce_shared_experts_fusion=True)
    assert d.value is False and d.rule == "sglang.nested_gate_silent"
    # DeepSeek-OCR-2 (its 896-dim projector): never fused
    ocr2 = dict(_ocr(topk_method="noaux_tc"), projector_config={"input_dim": 896})
    assert fused(ocr2, tp_size=8, enforce_shared_experts_fusion=True).value is False


def _minicpmv(version="4_6"):
    text = {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 4, "num_experts": 64, "num_experts_per_tok": 4,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}
    return {"architectures": [f"MiniCPMV{version}ForConditionalGeneration"], "text_config": text}


@pytest.mark.parametrize("version", ["4_6", "4_7"])
def test_minicpmv_builds_qwen35s_block_which_never_fuses_on_cuda(version):
    res = sglang(_minicpmv(version), tp_size=8, enforce_shared_experts_fusion=True)
    assert res.chain == (f"MiniCPMV{version}ForConditionalGeneration", "Qwen3_5MoeForCausalLM")
    d = res.decisions[Keys.SHARED_EXPERTS_FUSION]
    assert d.value is False and d.rule == "sglang.block.qwen2_moe.device"
    assert "qwen3_5.py" in d.reason and "ROCm with aiter" in d.reason


def test_under_the_loadplan_profile_minimax_m3_is_a_never_fuses_row_even_enforced():
    """loadplan's own rules have no fused layout for MiniMax-M3 (only SGLang's gate fuses it)."""
    for kw in ({}, {"enforce_shared_experts_fusion": True}):
        d = resolve(minimax_m3(), tp_size=1, **kw).decisions[Keys.SHARED_EXPERTS_FUSION]
        assert d.value is False and d.rule == "minimax_m3.structural.no_fused_layout"
