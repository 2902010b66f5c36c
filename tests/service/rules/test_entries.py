"""The entry-class table: families, wrappers, and the coverage check."""

from __future__ import annotations

import dataclasses

import pytest

from loadplan.errors import InvalidArgument, NotFound
from loadplan import layouts
from loadplan.service.rules import entries, gates
from loadplan.config_view import ConfigView
from loadplan.service.rules.entries import Direct, Family, Wrapper, chain_of, check_table, resolve_entry

from ._fixtures import deepseek, kimi_k25, resolve

BUILT = {
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLMNextN": "deepseek_nextn",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "KimiK25ForConditionalGeneration": "deepseek",
    "DeepseekV32ForCausalLM": "deepseek",
    "GlmMoeDsaForCausalLM": "deepseek",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3NextForCausalLMMTP": "qwen3_next_nextn",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5ForCausalLMMTP": "qwen3_5_nextn",
    "Dots1ForCausalLM": "deepseek",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "Glm4vMoeForConditionalGeneration": "glm4_moe",
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeSharedForCausalLM": "granitemoe_shared",
    "GraniteMoeSWAForCausalLM": "granitemoe_swa",
    "GraniteMoeHybridForCausalLM": "granitemoe_hybrid",
    "NemotronHForCausalLM": "nemotron_h",
    "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe",
    "ExaoneMoeForCausalLM": "exaone_moe",
    "Cohere2MoeForCausalLM": "cohere2_moe",
    "Step3p5ForCausalLM": "step3p5",
    "Step3p7ForConditionalGeneration": "step3p5",
    "SarvamMLAForCausalLM": "sarvam_mla",
    "HYV3ForCausalLM": "hy_v3",
    "Mistral4ForCausalLM": "mistral4",
    "AXK1ForCausalLM": "axk1",
    "MellumForCausalLM": "mellum",
    "FlintForCausalLM": "flint",
    "Kolibri1ForCausalLM": "kolibri1",
    "LagunaForCausalLM": "laguna",
    "SarvamMoEForCausalLM": "sarvam_moe",
    "AfmoeForCausalLM": "afmoe",
    "FlexOlmoForCausalLM": "flex_olmo",
    "Lfm2MoeForCausalLM": "lfm2_moe",
    "JambaForCausalLM": "jamba",
    "KimiLinearForCausalLM": "kimi_linear",
    "LongcatFlashForCausalLM": "longcat_flash",
    "SolarOpenForCausalLM": "solar_open",
    "BailingHybridForCausalLM": "bailing_hybrid",
    "MiniMaxForCausalLM": "minimax",
    "DbrxForCausalLM": "dbrx",
    "MiMoV2FlashForCausalLM": "mimo_v2_flash",
    "PhiMoEForCausalLM": "phimoe",
    "PhimoeForCausalLM": "phimoe",
}


def test_the_real_table_is_consistent():
    assert check_table() == []


def test_the_table_knows_the_issue_entry_classes():
    assert set(entries.ENTRY_CLASSES) >= set(BUILT)


@pytest.mark.parametrize("name,family", sorted(BUILT.items()))
def test_every_entry_class_reaches_its_family(name, family):
    chain = chain_of(name)
    built = entries.ENTRY_CLASSES[chain[-1]]
    assert isinstance(built, Direct) and built.family == family
    fam = entries.FAMILIES[family]
    assert fam.gated or not fam.has_shared_experts


def test_kimi_wrapper_chain():
    assert chain_of("KimiK25ForConditionalGeneration") == ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM")


def test_unknown_entry_class_is_not_found_listing_the_known_ones():
    with pytest.raises(NotFound) as e:
        chain_of("LlamaForCausalLM")
    assert e.value.field == "config.architectures"
    assert e.value.known == sorted(entries.ENTRY_CLASSES)
    assert "KimiK25ForConditionalGeneration" in e.value.message


def test_missing_inner_class_is_reported(monkeypatch):
    monkeypatch.setitem(entries.ENTRY_CLASSES, "FooVLForConditionalGeneration",
                        Wrapper("FooForCausalLM", "text_config", entries._top_level_quantization))
    problems = check_table()
    assert len(problems) == 1
    assert problems[0].startswith("FooVLForConditionalGeneration:")
    assert "FooForCausalLM" in problems[0]


def test_gated_family_without_gate_is_reported(monkeypatch):
    monkeypatch.setitem(entries.FAMILIES, "glm4_moe", dataclasses.replace(entries.FAMILIES["glm4_moe"], gate=None))
    assert check_table() == ["Glm4MoeForCausalLM: family glm4_moe has shared experts but no gate",
                             "Glm4vMoeForConditionalGeneration: family glm4_moe has shared experts but no gate"]


def test_wrapper_reaching_an_ungated_family_is_reported(monkeypatch):
    monkeypatch.setitem(entries.FAMILIES, "bar", Family("bar", layouts.deepseek_layout, None, True))
    monkeypatch.setitem(entries.ENTRY_CLASSES, "BarForCausalLM", Direct("bar"))
    monkeypatch.setitem(entries.ENTRY_CLASSES, "BarVLForConditionalGeneration",
                        Wrapper("BarForCausalLM", "text_config", entries._top_level_quantization))
    problems = check_table()
    assert sorted(p.split(":")[0] for p in problems) == ["BarForCausalLM", "BarVLForConditionalGeneration"]
    assert all("no gate" in p for p in problems)


def test_ungated_family_without_shared_experts_is_fine(monkeypatch):
    monkeypatch.setitem(entries.FAMILIES, "baz", Family("baz", layouts.deepseek_layout, None, False))
    monkeypatch.setitem(entries.ENTRY_CLASSES, "BazForCausalLM", Direct("baz"))
    assert check_table() == []


def test_entry_to_unknown_family_is_reported(monkeypatch):
    monkeypatch.setitem(entries.ENTRY_CLASSES, "QuxForCausalLM", Direct("qux"))
    assert check_table() == ["QuxForCausalLM: does not reach a family"]


def test_wrapper_cycle_is_reported(monkeypatch):
    q = entries._top_level_quantization
    monkeypatch.setitem(entries.ENTRY_CLASSES, "A", Wrapper("B", "text_config", q))
    monkeypatch.setitem(entries.ENTRY_CLASSES, "B", Wrapper("A", "text_config", q))
    problems = check_table()
    assert len(problems) == 2 and all("cycle" in p for p in problems)


def test_a_new_wrapper_is_just_a_row(monkeypatch):
    """Adding a wrapper needs no gate of its own: it answers with its inner family's."""
    monkeypatch.setitem(entries.ENTRY_CLASSES, "DeepseekVLV3ForConditionalGeneration",
                        Wrapper("DeepseekV3ForCausalLM", "language_config", entries._top_level_quantization))
    cfg = {"architectures": ["DeepseekVLV3ForConditionalGeneration"], "language_config": deepseek(n_shared_experts=2)}
    res = resolve(cfg)
    assert res.chain == ("DeepseekVLV3ForConditionalGeneration", "DeepseekV3ForCausalLM")
    assert res.decisions["moe.shared_experts_fusion"].rule == "deepseek.structural.n_shared_experts"
    with pytest.raises(InvalidArgument) as e:
        resolve({"architectures": ["DeepseekVLV3ForConditionalGeneration"]})
    assert e.value.field == "config.language_config"


# --- resolve_entry: what a wrapper hands its inner constructor ---------------

def test_missing_text_config_names_the_field():
    with pytest.raises(InvalidArgument) as e:
        resolve({"architectures": ["KimiK25ForConditionalGeneration"], "n_routed_experts": 384})
    assert e.value.field == "config.text_config"
    assert "missing" in str(e.value)
    assert "KimiK25ForConditionalGeneration builds DeepseekV3ForCausalLM" in str(e.value)


@pytest.mark.parametrize("bad", ["deepseek", [1, 2], 7])
def test_text_config_must_be_an_object(bad):
    with pytest.raises(InvalidArgument) as e:
        resolve({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": bad})
    assert e.value.field == "config.text_config"


def test_fields_inside_text_config_are_named_by_path():
    body = deepseek(n_routed_experts=384)
    del body["n_routed_experts"]
    with pytest.raises(InvalidArgument) as e:
        resolve(kimi_k25(body))
    assert e.value.field == "config.text_config.n_routed_experts"


@pytest.mark.parametrize("where", ["top", "text"])
def test_embedded_quantization_config_must_be_an_object(where):
    cfg = kimi_k25(deepseek())
    target = cfg if where == "top" else cfg["text_config"]
    target["quantization_config"] = "fp8"
    with pytest.raises(InvalidArgument) as e:
        resolve(cfg)
    assert e.value.field == ("config.quantization_config" if where == "top"
                             else "config.text_config.quantization_config")


def test_config_quantization_is_read_when_the_request_does_not_repeat_it():
    """A checkpoint whose config.json declares its quantization is never read as unquantized."""
    cfg = deepseek(quantization_config={"quant_method": "w4afp8"})
    r = resolve_entry("DeepseekV3ForCausalLM", ConfigView(cfg), None, None)
    assert r.quantization.name == "w4afp8"
    # the request's own quantization config, then an explicit name, take precedence
    r = resolve_entry("DeepseekV3ForCausalLM", ConfigView(cfg), None, {"quant_method": "fp8"})
    assert r.quantization.name == "fp8"
    r = resolve_entry("DeepseekV3ForCausalLM", ConfigView(cfg), "quark", None)
    assert r.quantization.name == "quark"


def test_resolved_wrapper_carries_the_inner_view():
    r = resolve_entry("KimiK25ForConditionalGeneration", ConfigView(kimi_k25()), None, {"quant_method": "quark"})
    assert r.family is entries.FAMILIES["deepseek"]
    assert r.fused_architecture == "DeepseekV3ForCausalLM"
    assert r.cfg.path == "config.text_config"
    assert r.cfg.int("n_routed_experts") == 384
    assert r.quantization.name == "quark"


def test_fused_architecture_per_entry_class():
    def fused(name, cfg):
        return resolve_entry(name, ConfigView(cfg), None, None).fused_architecture

    assert fused("DeepseekV2ForCausalLM", deepseek()) == "DeepseekV3ForCausalLM"
    assert fused("DeepseekV3ForCausalLMNextN", deepseek()) == "DeepseekV3ForCausalLMNextN"
    assert fused("Glm4MoeForCausalLM", deepseek()) == "Glm4MoeForCausalLM"


def test_every_gate_is_a_function_of_the_gates_module():
    for fam in entries.FAMILIES.values():
        assert fam.gate is None or fam.gate.__module__ == gates.__name__
