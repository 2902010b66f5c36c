"""The one table of entry classes: what `architectures[0]` builds, for the rules and the engine alike.

An entry class either builds a model family directly (`direct`) or is a wrapper that builds an inner entry
class from part of its config (`wrapper`). `engine` names the module under `loadplan.engine.models` that holds
the loadplan engine's class of the same name, as a string (vLLM's `models/registry.py` style): nothing is
imported until a model is built, so this table is read without torch by the registry, and without grpc by the
engine. An entry with `engine=None` is *rules only*: the registry plans it (for an engine that builds it, such
as SGLang), loadplan's engine does not build it, and `loadplan coverage` says so.

It lives in `loadplan/` (beside `plan.py`, the vocabulary every part shares) because both
`loadplan.service.rules` (the registry's extra) and `loadplan.engine` (the engine's extra) read it, and neither
may import the other's dependencies.

Readers: `loadplan.service.rules.entries` (families, gates, quantization hand-down) and
`loadplan.engine.registry` (`ENGINE_ENTRY_CLASSES`, `ENGINE_WRAPPERS`).
"""

from __future__ import annotations

from dataclasses import dataclass

# What a wrapper hands its inner constructor as quantization:
# "top_level": the checkpoint's quantization (the request's, else the config's own, else text_config's);
# "none": nothing (SGLang's DeepseekVL2 builds its language model with quant_config=None).
QUANTIZATION_HANDOFFS = ("top_level", "none")


@dataclass(frozen=True)
class EntryClass:
    family: str | None = None              # the family it builds (None: a wrapper)
    engine: str | None = None              # module under loadplan.engine.models; None: rules only
    inner: str | None = None               # a wrapper's inner entry class
    config_field: str | None = None        # the part of a wrapper's config the inner constructor receives
    quantization: str = "top_level"        # a wrapper's hand-down (QUANTIZATION_HANDOFFS)
    fused_architecture: str | None = None  # overrides the family's (a NextN draft declares its own)
    # Reads its text model's config from `text_config` when the config has one (a multimodal target's
    # config.json), with the quantization a wrapper hands down; else the config itself.
    text_config_if_present: bool = False

    @property
    def is_wrapper(self) -> bool:
        return self.inner is not None

    @property
    def rules_only(self) -> bool:
        return self.engine is None


def direct(family: str, engine: str | None, **kw) -> EntryClass:
    return EntryClass(family=family, engine=engine, **kw)


def wrapper(inner: str, config_field: str, engine: str | None, quantization: str = "top_level") -> EntryClass:
    return EntryClass(engine=engine, inner=inner, config_field=config_field, quantization=quantization)


ENGINE_PACKAGE = "loadplan.engine.models"

ENTRY_CLASSES: dict[str, EntryClass] = {
    "DeepseekV2ForCausalLM": direct("deepseek", "deepseek_v3"),
    "DeepseekV3ForCausalLM": direct("deepseek", "deepseek_v3"),
    # V3.2: V3's family and gate; not the fused architecture, so never fused (DESIGN 5.2, condition 4)
    "DeepseekV32ForCausalLM": direct("deepseek", "deepseek_v3"),
    # GLM-5: V3.2's model; the DeepSeek gate with its own fused architecture, as SGLang's GlmMoeDsaForCausalLM
    "GlmMoeDsaForCausalLM": direct("deepseek", "deepseek_v3", fused_architecture="GlmMoeDsaForCausalLM"),
    "DeepseekV3ForCausalLMNextN": direct("deepseek_nextn", "deepseek_nextn",
                                         fused_architecture="DeepseekV3ForCausalLMNextN"),
    # dots.llm1: DeepSeek-V3's MoE block (its config names it alike) under Qwen3's attention; the DeepSeek gate,
    # whose structural conditions never fuse it (not the fused architecture; it ships 2 shared experts)
    "Dots1ForCausalLM": direct("deepseek", "dots1"),
    "Ernie4_5_MoeForCausalLM": direct("ernie4_5_moe", "ernie4_5_moe"),
    "Glm4MoeForCausalLM": direct("glm4_moe", "glm4_moe"),
    "Glm4MoeForCausalLMNextN": direct("glm4_moe_nextn", "glm4_moe_nextn", fused_architecture="Glm4MoeForCausalLMNextN"),
    "Qwen2MoeForCausalLM": direct("qwen2_moe", "qwen_moe"),
    "Qwen3MoeForCausalLM": direct("qwen3_moe", "qwen_moe"),
    "MixtralForCausalLM": direct("mixtral", "mixtral"),
    "OlmoeForCausalLM": direct("olmoe", "olmoe"),
    "FlexOlmoForCausalLM": direct("flex_olmo", "flex_olmo"),
    "Lfm2MoeForCausalLM": direct("lfm2_moe", "lfm2_moe"),
    "JambaForCausalLM": direct("jamba", "jamba"),
    "DbrxForCausalLM": direct("dbrx", "dbrx"),
    "MiMoV2FlashForCausalLM": direct("mimo_v2_flash", "mimo_v2_flash"),
    "GptOssForCausalLM": direct("gpt_oss", "gpt_oss"),
    "MiniMaxM2ForCausalLM": direct("minimax_m2", "minimax_m2"),
    "MiniMaxForCausalLM": direct("minimax", "minimax"),
    "GraniteMoeForCausalLM": direct("granitemoe", "granitemoe"),
    "GraniteMoeSharedForCausalLM": direct("granitemoe_shared", "granitemoe"),
    "GraniteMoeSWAForCausalLM": direct("granitemoe_swa", "granitemoe"),
    "GraniteMoeHybridForCausalLM": direct("granitemoe_hybrid", "granitemoe_hybrid"),
    "NemotronHForCausalLM": direct("nemotron_h", "nemotron_h"),
    "HunYuanMoEV1ForCausalLM": direct("hunyuan_v1_moe", "hunyuan_v1_moe"),
    "ExaoneMoeForCausalLM": direct("exaone_moe", "exaone_moe"),
    "Cohere2MoeForCausalLM": direct("cohere2_moe", "cohere2_moe"),
    "Step3p5ForCausalLM": direct("step3p5", "step3p5"),
    "SarvamMLAForCausalLM": direct("sarvam_mla", "sarvam"),
    "HYV3ForCausalLM": direct("hy_v3", "hy_v3"),
    "Mistral4ForCausalLM": direct("mistral4", "mistral4"),
    "AXK1ForCausalLM": direct("axk1", "axk1"),
    "MellumForCausalLM": direct("mellum", "mellum"),
    "FlintForCausalLM": direct("flint", "flint"),
    "Kolibri1ForCausalLM": direct("kolibri1", "kolibri1"),
    "LagunaForCausalLM": direct("laguna", "laguna"),
    "SarvamMoEForCausalLM": direct("sarvam_moe", "sarvam"),
    "KimiLinearForCausalLM": direct("kimi_linear", "kimi_linear"),
    "LongcatFlashForCausalLM": direct("longcat_flash", "longcat_flash"),
    "SolarOpenForCausalLM": direct("solar_open", "solar_open"),
    "BailingHybridForCausalLM": direct("bailing_hybrid", "bailing_hybrid"),
    "AfmoeForCausalLM": direct("afmoe", "afmoe"),
    # Phi-3.5-MoE: the Hub's spelling, and transformers' (what its save_pretrained writes)
    "PhiMoEForCausalLM": direct("phimoe", "phimoe"),
    "PhimoeForCausalLM": direct("phimoe", "phimoe"),
    "Llama4ForCausalLM": direct("llama4", "llama4"),
    "Glm4MoeLiteForCausalLM": direct("glm4_moe_lite", "glm4_moe_lite"),
    "Qwen3NextForCausalLM": direct("qwen3_next", "qwen3_next"),
    "Qwen3NextForCausalLMMTP": direct("qwen3_next_nextn", "qwen3_next_nextn"),
    "Qwen3_5MoeForCausalLM": direct("qwen3_5_moe", "qwen3_5_moe"),
    # SGLang's name for the draft of any Qwen3.5 target; its config.json is the target's (the Hub's wrapper
    # config, its text model's under text_config, or the text model's own)
    "Qwen3_5ForCausalLMMTP": direct("qwen3_5_nextn", "qwen3_5_nextn", text_config_if_present=True),
    # Rules only: SGLang's wrappers into DeepSeek-V2's class (DESIGN 8.1). KimiVL hands its text_config over as a
    # DeepseekV2ForCausalLM (so never the fused architecture); DotsVLM its language_config; DeepseekVL2 its
    # language_config and no quantization (its language model is built with quant_config=None).
    "KimiVLForConditionalGeneration": wrapper("DeepseekV2ForCausalLM", "text_config", None),
    "DotsVLMForCausalLM": wrapper("DeepseekV2ForCausalLM", "language_config", None),
    "DeepseekVL2ForCausalLM": wrapper("DeepseekV2ForCausalLM", "language_config", None, quantization="none"),
    # Rules only: GLM-4.7-Flash's NextN draft as SGLang builds it (loadplan's engine builds no GLM-4.7-Flash draft)
    "Glm4MoeLiteForCausalLMNextN": direct("glm4_moe_lite_nextn", None, fused_architecture="Glm4MoeLiteForCausalLMNextN"),
    # Rules only: SGLang's dense Qwen3, a standalone draft beside a Qwen3-MoE target (loadplan's engine builds MoE
    # families only)
    "Qwen3ForCausalLM": direct("dense", None),
    # Rules only: the families and wrappers SGLang 0.5.23 gates beyond loadplan's engine (DESIGN 8.1); their gates
    # are the sglang profile's (service/rules/sglang.py: GATES), paths under sglang/srt/models/.
    # minimax_m3.py: MiniMaxM3SparseForCausalLM, its own config, its own gate (a shared expert sized n_shared_experts)
    "MiniMaxM3SparseForCausalLM": direct("minimax_m3", None),
    # deepseek_v4.py: DeepseekV4ForCausalLM, DeepSeek-V2's MoE block (DeepseekV2MoE) under its own gate
    "DeepseekV4ForCausalLM": direct("deepseek_v4", None),
    # dots3.py -> dots3_common/modeling.py: Dots3NoteForCausalLM hands its own (flat) config to
    # Dots3LanguageModelForCausalLM, DeepSeek's expert fields, its own gate and fused architecture
    "Dots3NoteForCausalLM": direct("dots3", None),
    # mistral_large_3.py: MistralLarge3ForCausalLM subclasses DeepseekV3ForCausalLM (its gate and fused architecture)
    "MistralLarge3ForCausalLM": direct("deepseek", None),
    # pixtral.py: PixtralForConditionalGeneration builds MistralLarge3ForCausalLM from text_config (when its
    # model_type is deepseek_v3) with the checkpoint's quantization
    "PixtralForConditionalGeneration": wrapper("MistralLarge3ForCausalLM", "text_config", None),
    # deepseek_ocr.py: DeepseekOCRForCausalLM builds DeepSeek-V2's model from its hf_config.text_config, which
    # SGLang's config class (configs/deepseek_ocr.py: DeepseekVLV2Config) reads from config.json's language_config,
    # with the checkpoint's quantization, and asks DeepseekV2ForCausalLM's gate with it
    "DeepseekOCRForCausalLM": wrapper("DeepseekV2ForCausalLM", "language_config", None),
    # minicpmv.py: MiniCPM-V 4.6 / 4.7 build a Qwen3.5 text model (Qwen3_5MoeForCausalLM for a MoE text_config)
    # from text_config with the checkpoint's quantization
    "MiniCPMV4_6ForConditionalGeneration": wrapper("Qwen3_5MoeForCausalLM", "text_config", None),
    "MiniCPMV4_7ForConditionalGeneration": wrapper("Qwen3_5MoeForCausalLM", "text_config", None),
    "Llama4ForConditionalGeneration": wrapper("Llama4ForCausalLM", "text_config", "llama4"),
    "Qwen3VLMoeForConditionalGeneration": wrapper("Qwen3MoeForCausalLM", "text_config", "qwen3_vl_moe"),
    # GLM-4.5V run text-only: GLM-4-MoE's text model; its gate is GLM-4-MoE's, asked with text_config
    "Glm4vMoeForConditionalGeneration": wrapper("Glm4MoeForCausalLM", "text_config", "glm4v_moe"),
    # Step-3.7-Flash run text-only: Step-3.5's text model, its gate asked with text_config
    "Step3p7ForConditionalGeneration": wrapper("Step3p5ForCausalLM", "text_config", "step3p7"),
    "KimiK25ForConditionalGeneration": wrapper("DeepseekV3ForCausalLM", "text_config", "deepseek_v3"),
    "Qwen3_5MoeForConditionalGeneration": wrapper("Qwen3_5MoeForCausalLM", "text_config", "qwen3_5_moe"),
}


def engine_module(name: str) -> str | None:
    """The module that holds the loadplan engine's class `name`; None where the entry is rules only."""
    row = ENTRY_CLASSES[name]
    return None if row.engine is None else f"{ENGINE_PACKAGE}.{row.engine}"
