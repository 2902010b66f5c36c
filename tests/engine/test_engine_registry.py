"""The engine's entry-class table: lazy, actionable errors, and in step with the registry's table."""

from __future__ import annotations

import pytest

from loadplan.engine import registry as engine_registry
from loadplan.engine.registry import (ENGINE_ENTRY_CLASSES, ENGINE_WRAPPERS, EngineWrapper, UnsupportedModel,
                                      engine_chain, model_class)
from loadplan.service.coverage import coverage_of
from loadplan.service.rules import entries


def test_qwen_classes_resolve_lazily():
    cls = model_class("Qwen3MoeForCausalLM")
    assert cls.__name__ == "Qwen3MoeForCausalLM" and cls.__module__ == "loadplan.engine.models.qwen_moe"
    assert model_class("Qwen2MoeForCausalLM").ARCHITECTURE == "Qwen2MoeForCausalLM"


def test_unknown_entry_class_lists_the_supported_ones():
    with pytest.raises(UnsupportedModel, match=r"'LlamaForCausalLM' not supported by the engine; supported: "
                                               r"AXK1ForCausalLM, AfmoeForCausalLM, BailingHybridForCausalLM, "
                                               r"Cohere2MoeForCausalLM, "
                                               r"DbrxForCausalLM, DeepseekV2ForCausalLM, DeepseekV32ForCausalLM, "
                                               r"DeepseekV3ForCausalLM, DeepseekV3ForCausalLMNextN, "
                                               r"Dots1ForCausalLM, Ernie4_5_MoeForCausalLM, ExaoneMoeForCausalLM, "
                                               r"FlexOlmoForCausalLM, FlintForCausalLM, Glm4MoeForCausalLM, "
                                               r"Glm4MoeForCausalLMNextN, Glm4MoeLiteForCausalLM, "
                                               r"Glm4vMoeForConditionalGeneration, GlmMoeDsaForCausalLM, "
                                               r"GptOssForCausalLM, GraniteMoeForCausalLM, "
                                               r"GraniteMoeHybridForCausalLM, GraniteMoeSWAForCausalLM, GraniteMoeSharedForCausalLM, "
                                               r"HYV3ForCausalLM, HunYuanMoEV1ForCausalLM, JambaForCausalLM, "
                                               r"KimiK25ForConditionalGeneration, KimiLinearForCausalLM, "
                                               r"Kolibri1ForCausalLM, "
                                               r"LagunaForCausalLM, Lfm2MoeForCausalLM, "
                                               r"Llama4ForCausalLM, "
                                               r"Llama4ForConditionalGeneration, LongcatFlashForCausalLM, "
                                               r"MellumForCausalLM, MiMoV2FlashForCausalLM, MiniMaxForCausalLM, "
                                               r"MiniMaxM2ForCausalLM, "
                                               r"Mistral4ForCausalLM, "
                                               r"MixtralForCausalLM, "
                                               r"NemotronHForCausalLM, OlmoeForCausalLM, "
                                               r"PhiMoEForCausalLM, PhimoeForCausalLM, "
                                               r"Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, Qwen3NextForCausalLM, "
                                               r"Qwen3NextForCausalLMMTP, "
                                               r"Qwen3VLMoeForConditionalGeneration, Qwen3_5ForCausalLMMTP, "
                                               r"Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, "
                                               r"SarvamMLAForCausalLM, SarvamMoEForCausalLM, "
                                               r"SolarOpenForCausalLM, Step3p5ForCausalLM, "
                                               r"Step3p7ForConditionalGeneration"):
        model_class("LlamaForCausalLM")


@pytest.mark.parametrize("name", sorted(ENGINE_ENTRY_CLASSES))
def test_every_engine_class_has_the_registrys_chain_and_reaches_a_gate_when_needed(name):
    assert engine_chain(name) == entries.chain_of(name)
    cov = coverage_of(name)
    assert cov.ok, cov.message


@pytest.mark.parametrize("name", sorted(ENGINE_WRAPPERS))
def test_wrappers_hand_down_the_same_config_field(name):
    reg = entries.ENTRY_CLASSES[name]
    assert isinstance(reg, entries.Wrapper)
    assert (ENGINE_WRAPPERS[name].inner, ENGINE_WRAPPERS[name].config_field) == (reg.inner, reg.config_field)


def test_a_wrapper_the_registry_does_not_gate_fails_the_check(monkeypatch):
    monkeypatch.setitem(engine_registry.ENGINE_ENTRY_CLASSES, "UngatedVLForConditionalGeneration",
                        ("loadplan.engine.models.deepseek_v3", "UngatedVL"))
    wrappers = {**ENGINE_WRAPPERS, "UngatedVLForConditionalGeneration":
                EngineWrapper("DeepseekV3ForCausalLM", "text_config")}
    assert engine_chain("UngatedVLForConditionalGeneration", wrappers)[-1] == "DeepseekV3ForCausalLM"
    cov = coverage_of("UngatedVLForConditionalGeneration")
    assert not cov.ok and "not supported by the registry" in cov.message


def test_a_wrapper_cycle_is_refused(monkeypatch):
    monkeypatch.setitem(engine_registry.ENGINE_ENTRY_CLASSES, "A", ("x", "A"))
    with pytest.raises(UnsupportedModel, match="cycle"):
        engine_chain("A", {"A": EngineWrapper("A", "text_config")})
