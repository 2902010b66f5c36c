"""The engine's table of entry classes: data, with lazy imports (vLLM-registry style).

An entry class is `architectures[0]` of a checkpoint's config.json. Each row says
which module and class build it; nothing is imported until a model is built, so
listing what the engine supports costs nothing. `ENGINE_WRAPPERS` says which inner
entry class a wrapper builds (and from which part of its config), so the coverage
check can compare the engine's chains with the registry's (`engine_chain`).

Adding a model family:
1. write `engine/models/<family>.py` following the conventions in
   `loadplan.engine.models` (constructor `(hf_config: dict, plan: GuardedPlan, *,
   dtype)`, `load_weights`, `routed_experts_weights_of_layer`, ...);
2. add a row here (and in `ENGINE_WRAPPERS` for a wrapper);
3. the registry's table (`service/rules/entries.py`) must know the class too, with
   a gate if the family has shared experts: `loadplan coverage` checks both.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# entry class -> (module, class name)
ENGINE_ENTRY_CLASSES: dict[str, tuple[str, str]] = {
    "Qwen3MoeForCausalLM": ("loadplan.engine.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("loadplan.engine.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("loadplan.engine.models.deepseek_v3", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("loadplan.engine.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("loadplan.engine.models.deepseek_v3", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("loadplan.engine.models.deepseek_v3", "GlmMoeDsaForCausalLM"),
    "DeepseekV3ForCausalLMNextN": ("loadplan.engine.models.deepseek_nextn", "DeepseekV3ForCausalLMNextN"),
    "Glm4MoeForCausalLM": ("loadplan.engine.models.glm4_moe", "Glm4MoeForCausalLM"),
    "Dots1ForCausalLM": ("loadplan.engine.models.dots1", "Dots1ForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("loadplan.engine.models.ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "GraniteMoeForCausalLM": ("loadplan.engine.models.granitemoe", "GraniteMoeForCausalLM"),
    "GraniteMoeSharedForCausalLM": ("loadplan.engine.models.granitemoe", "GraniteMoeSharedForCausalLM"),
    "GraniteMoeSWAForCausalLM": ("loadplan.engine.models.granitemoe", "GraniteMoeSWAForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("loadplan.engine.models.granitemoe_hybrid", "GraniteMoeHybridForCausalLM"),
    "NemotronHForCausalLM": ("loadplan.engine.models.nemotron_h", "NemotronHForCausalLM"),
    "JambaForCausalLM": ("loadplan.engine.models.jamba", "JambaForCausalLM"),
    "HunYuanMoEV1ForCausalLM": ("loadplan.engine.models.hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM"),
    "ExaoneMoeForCausalLM": ("loadplan.engine.models.exaone_moe", "ExaoneMoeForCausalLM"),
    "AfmoeForCausalLM": ("loadplan.engine.models.afmoe", "AfmoeForCausalLM"),
    "FlexOlmoForCausalLM": ("loadplan.engine.models.flex_olmo", "FlexOlmoForCausalLM"),
    "Lfm2MoeForCausalLM": ("loadplan.engine.models.lfm2_moe", "Lfm2MoeForCausalLM"),
    "DbrxForCausalLM": ("loadplan.engine.models.dbrx", "DbrxForCausalLM"),
    "Cohere2MoeForCausalLM": ("loadplan.engine.models.cohere2_moe", "Cohere2MoeForCausalLM"),
    "Step3p5ForCausalLM": ("loadplan.engine.models.step3p5", "Step3p5ForCausalLM"),
    "SarvamMLAForCausalLM": ("loadplan.engine.models.sarvam", "SarvamMLAForCausalLM"),
    "SarvamMoEForCausalLM": ("loadplan.engine.models.sarvam", "SarvamMoEForCausalLM"),
    "HYV3ForCausalLM": ("loadplan.engine.models.hy_v3", "HYV3ForCausalLM"),
    "Mistral4ForCausalLM": ("loadplan.engine.models.mistral4", "Mistral4ForCausalLM"),
    "LagunaForCausalLM": ("loadplan.engine.models.laguna", "LagunaForCausalLM"),
    "AXK1ForCausalLM": ("loadplan.engine.models.axk1", "AXK1ForCausalLM"),
    "MellumForCausalLM": ("loadplan.engine.models.mellum", "MellumForCausalLM"),
    "FlintForCausalLM": ("loadplan.engine.models.flint", "FlintForCausalLM"),
    "Kolibri1ForCausalLM": ("loadplan.engine.models.kolibri1", "Kolibri1ForCausalLM"),
    "MiMoV2FlashForCausalLM": ("loadplan.engine.models.mimo_v2_flash", "MiMoV2FlashForCausalLM"),
    "PhiMoEForCausalLM": ("loadplan.engine.models.phimoe", "PhiMoEForCausalLM"),
    "PhimoeForCausalLM": ("loadplan.engine.models.phimoe", "PhimoeForCausalLM"),
    "Glm4MoeForCausalLMNextN": ("loadplan.engine.models.glm4_moe_nextn", "Glm4MoeForCausalLMNextN"),
    "KimiK25ForConditionalGeneration": ("loadplan.engine.models.deepseek_v3", "KimiK25ForConditionalGeneration"),
    "KimiLinearForCausalLM": ("loadplan.engine.models.kimi_linear", "KimiLinearForCausalLM"),
    "LongcatFlashForCausalLM": ("loadplan.engine.models.longcat_flash", "LongcatFlashForCausalLM"),
    "SolarOpenForCausalLM": ("loadplan.engine.models.solar_open", "SolarOpenForCausalLM"),
    "BailingHybridForCausalLM": ("loadplan.engine.models.bailing_hybrid", "BailingHybridForCausalLM"),
    "MixtralForCausalLM": ("loadplan.engine.models.mixtral", "MixtralForCausalLM"),
    "OlmoeForCausalLM": ("loadplan.engine.models.olmoe", "OlmoeForCausalLM"),
    "GptOssForCausalLM": ("loadplan.engine.models.gpt_oss", "GptOssForCausalLM"),
    "MiniMaxM2ForCausalLM": ("loadplan.engine.models.minimax_m2", "MiniMaxM2ForCausalLM"),
    "MiniMaxForCausalLM": ("loadplan.engine.models.minimax", "MiniMaxForCausalLM"),
    "Llama4ForCausalLM": ("loadplan.engine.models.llama4", "Llama4ForCausalLM"),
    "Glm4MoeLiteForCausalLM": ("loadplan.engine.models.glm4_moe_lite", "Glm4MoeLiteForCausalLM"),
    "Qwen3VLMoeForConditionalGeneration": ("loadplan.engine.models.qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"),
    "Glm4vMoeForConditionalGeneration": ("loadplan.engine.models.glm4v_moe", "Glm4vMoeForConditionalGeneration"),
    "Step3p7ForConditionalGeneration": ("loadplan.engine.models.step3p7", "Step3p7ForConditionalGeneration"),
    "Qwen3NextForCausalLM": ("loadplan.engine.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3NextForCausalLMMTP": ("loadplan.engine.models.qwen3_next_nextn", "Qwen3NextForCausalLMMTP"),
    "Qwen3_5MoeForCausalLM": ("loadplan.engine.models.qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("loadplan.engine.models.qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
    "Qwen3_5ForCausalLMMTP": ("loadplan.engine.models.qwen3_5_nextn", "Qwen3_5ForCausalLMMTP"),
    "Llama4ForConditionalGeneration": ("loadplan.engine.models.llama4", "Llama4ForConditionalGeneration"),
}


@dataclass(frozen=True)
class EngineWrapper:
    inner: str            # the entry class its constructor builds
    config_field: str     # the part of its config that constructor receives


# Wrappers: their engine class builds `inner` from `config[config_field]`.
ENGINE_WRAPPERS: dict[str, EngineWrapper] = {
    "KimiK25ForConditionalGeneration": EngineWrapper("DeepseekV3ForCausalLM", "text_config"),
    "Llama4ForConditionalGeneration": EngineWrapper("Llama4ForCausalLM", "text_config"),
    "Qwen3VLMoeForConditionalGeneration": EngineWrapper("Qwen3MoeForCausalLM", "text_config"),
    "Glm4vMoeForConditionalGeneration": EngineWrapper("Glm4MoeForCausalLM", "text_config"),
    "Step3p7ForConditionalGeneration": EngineWrapper("Step3p5ForCausalLM", "text_config"),
    "Qwen3_5MoeForConditionalGeneration": EngineWrapper("Qwen3_5MoeForCausalLM", "text_config"),
}


class UnsupportedModel(ValueError):
    """An entry class the engine cannot build."""


def supported() -> list[str]:
    return sorted(ENGINE_ENTRY_CLASSES)


def _check(name: str) -> None:
    if name not in ENGINE_ENTRY_CLASSES:
        raise UnsupportedModel(f"entry class {name!r} not supported by the engine; supported: {', '.join(supported())}")


def model_class(name: str) -> type:
    """The engine class for entry class `name` (imports its module on first use)."""
    _check(name)
    module, cls = ENGINE_ENTRY_CLASSES[name]
    return getattr(importlib.import_module(module), cls)


def engine_chain(name: str, wrappers: dict[str, EngineWrapper] | None = None) -> tuple[str, ...]:
    """`name`, then each inner class its wrappers build, outermost first (like the registry's chain_of)."""
    wrappers = ENGINE_WRAPPERS if wrappers is None else wrappers
    _check(name)
    chain = [name]
    while chain[-1] in wrappers:
        inner = wrappers[chain[-1]].inner
        if inner in chain:
            raise UnsupportedModel(f"engine wrapper cycle: {' -> '.join(chain + [inner])}")
        chain.append(inner)
    return tuple(chain)
