"""Every family's tiny checkpoint, by entry class: what the tests that run each family alike build (the multi-rank
tests, the bfloat16 test). Importable by name, in spawned ranks too."""

from __future__ import annotations

import json
from pathlib import Path

import engine_helpers
from engine_helpers import (make_checkpoint, make_deepseek_checkpoint, make_deepseek_v2_checkpoint,
                            make_glm4_checkpoint, make_gpt_oss_checkpoint, make_llama4_checkpoint,
                            make_minimax_m2_checkpoint, make_mixtral_checkpoint, make_olmoe_checkpoint,
                            make_qwen3_5_moe_checkpoint, make_qwen3_next_checkpoint)

QWEN3 = "Qwen3MoeForCausalLM"
QWEN2 = "Qwen2MoeForCausalLM"
DEEPSEEK = "DeepseekV3ForCausalLM"
GLM4 = "Glm4MoeForCausalLM"
DEEPSEEK_V2 = "DeepseekV2ForCausalLM"
MIXTRAL = "MixtralForCausalLM"
OLMOE = "OlmoeForCausalLM"
GPT_OSS = "GptOssForCausalLM"
MINIMAX_M2 = "MiniMaxM2ForCausalLM"
LLAMA4 = "Llama4ForCausalLM"
QWEN3_NEXT = "Qwen3NextForCausalLM"
QWEN3_5_MOE = "Qwen3_5MoeForConditionalGeneration"
DEEPSEEK_V32 = "DeepseekV32ForCausalLM"
GLM_MOE_DSA = "GlmMoeDsaForCausalLM"
DOTS1 = "Dots1ForCausalLM"
ERNIE4_5_MOE = "Ernie4_5_MoeForCausalLM"
GLM4V_MOE = "Glm4vMoeForConditionalGeneration"
GRANITEMOE = "GraniteMoeForCausalLM"
GRANITEMOE_SHARED = "GraniteMoeSharedForCausalLM"
GRANITEMOE_SWA = "GraniteMoeSWAForCausalLM"
GRANITEMOE_HYBRID = "GraniteMoeHybridForCausalLM"
NEMOTRON_H = "NemotronHForCausalLM"
JAMBA = "JambaForCausalLM"
KIMI_LINEAR = "KimiLinearForCausalLM"
LONGCAT_FLASH = "LongcatFlashForCausalLM"
SOLAR_OPEN = "SolarOpenForCausalLM"
BAILING_HYBRID = "BailingHybridForCausalLM"
MINIMAX = "MiniMaxForCausalLM"
HUNYUAN = "HunYuanMoEV1ForCausalLM"
PHIMOE = "PhimoeForCausalLM"
EXAONE_MOE = "ExaoneMoeForCausalLM"
AFMOE = "AfmoeForCausalLM"
FLEX_OLMO = "FlexOlmoForCausalLM"
LFM2_MOE = "Lfm2MoeForCausalLM"
DBRX = "DbrxForCausalLM"
MIMO_V2_FLASH = "MiMoV2FlashForCausalLM"
COHERE2_MOE = "Cohere2MoeForCausalLM"
# Step-3.5's text model, run behind Step-3.7's wrapper (transformers' reference for both: tests/engine/models/
# test_step3p5.py)
STEP3P7 = "Step3p7ForConditionalGeneration"
HY_V3 = "HYV3ForCausalLM"
MISTRAL4 = "Mistral4ForCausalLM"
LAGUNA = "LagunaForCausalLM"
AXK1 = "AXK1ForCausalLM"
MELLUM = "MellumForCausalLM"
FLINT = "FlintForCausalLM"
KOLIBRI1 = "Kolibri1ForCausalLM"
SARVAM_MLA = "SarvamMLAForCausalLM"
SARVAM_MOE = "SarvamMoEForCausalLM"
# transformers' class for an entry class it has none of its own for (it builds Sarvam's from their model_type)
REFERENCE_CLASS = {SARVAM_MLA: "AutoModelForCausalLM", SARVAM_MOE: "AutoModelForCausalLM"}

# engine_helpers' tiny DeepSeek-V3 (256 routed experts: the fusion gate passes) with the default rope.
DEEPSEEK_TINY = dict(engine_helpers.DEEPSEEK_TINY, rope_theta=10000.0)


def make_deepseek(path: Path, seed: int = 0) -> Path:
    return make_deepseek_checkpoint(path, seed=seed, **DEEPSEEK_TINY)


# arch -> how to save its tiny checkpoint (path, seed); any other arch: engine_helpers.make_checkpoint's Qwen ones.
MAKERS = {
    DEEPSEEK: lambda path, seed: make_deepseek(path, seed),
    GLM4: lambda path, seed: make_glm4_checkpoint(path, seed=seed, **engine_helpers.GLM4_TINY),
    DEEPSEEK_V2: lambda path, seed: make_deepseek_v2_checkpoint(path, seed=seed, **engine_helpers.DEEPSEEK_V2_TINY),
    MIXTRAL: lambda path, seed: make_mixtral_checkpoint(path, seed=seed),
    OLMOE: lambda path, seed: make_olmoe_checkpoint(path, seed=seed),
    GPT_OSS: lambda path, seed: make_gpt_oss_checkpoint(path, seed=seed),
    MINIMAX_M2: lambda path, seed: make_minimax_m2_checkpoint(path, seed=seed),
    LLAMA4: lambda path, seed: make_llama4_checkpoint(path, seed=seed),
    QWEN3_NEXT: lambda path, seed: make_qwen3_next_checkpoint(path, seed=seed),
    # Its last layer reuses the top-k of the one before it (no indexer of its own): both kinds on every rank.
    GLM_MOE_DSA: lambda path, seed: engine_helpers.make_glm_moe_dsa_checkpoint(path, seed=seed, index_topk_freq=2),
    DOTS1: lambda path, seed: engine_helpers.make_dots1_checkpoint(path, seed=seed),
    ERNIE4_5_MOE: lambda path, seed: engine_helpers.make_ernie4_5_moe_checkpoint(path, seed=seed),
    GLM4V_MOE: lambda path, seed: engine_helpers.make_glm4v_moe_checkpoint(path, seed=seed),
    GRANITEMOE: lambda path, seed: engine_helpers.make_granitemoe_checkpoint(path, seed=seed),
    GRANITEMOE_SHARED: lambda path, seed: engine_helpers.make_granitemoe_checkpoint(
        path, seed=seed, family="GraniteMoeShared", shared_intermediate_size=24),
    GRANITEMOE_SWA: lambda path, seed: engine_helpers.make_granitemoe_checkpoint(
        path, seed=seed, family="GraniteMoeSWA", **engine_helpers.GRANITEMOE_SWA_TINY),
    GRANITEMOE_HYBRID: lambda path, seed: engine_helpers.make_granitemoe_hybrid_checkpoint(path, seed=seed),
    NEMOTRON_H: lambda path, seed: engine_helpers.make_nemotron_h_checkpoint(path, seed=seed),
    JAMBA: lambda path, seed: engine_helpers.make_jamba_checkpoint(path, seed=seed),
    KIMI_LINEAR: lambda path, seed: engine_helpers.make_kimi_linear_checkpoint(path, seed=seed),
    LONGCAT_FLASH: lambda path, seed: engine_helpers.make_longcat_flash_checkpoint(path, seed=seed),
    SOLAR_OPEN: lambda path, seed: engine_helpers.make_solar_open_checkpoint(path, seed=seed),
    BAILING_HYBRID: lambda path, seed: engine_helpers.make_bailing_hybrid_checkpoint(path, seed=seed),
    MINIMAX: lambda path, seed: engine_helpers.make_minimax_checkpoint(path, seed=seed),
    # 2 key/value heads on the global layer, 4 on the windowed ones: both split over 2 TP ranks
    MIMO_V2_FLASH: lambda path, seed: engine_helpers.make_mimo_v2_flash_checkpoint(path, seed=seed,
                                                                                   num_key_value_heads=2),
    DBRX: lambda path, seed: engine_helpers.make_dbrx_checkpoint(path, seed=seed),
    LFM2_MOE: lambda path, seed: engine_helpers.make_lfm2_moe_checkpoint(path, seed=seed),
    # heads of 6: q's norm spans 24 features, not hidden_size's 32
    FLEX_OLMO: lambda path, seed: engine_helpers.make_flex_olmo_checkpoint(path, seed=seed, head_dim=6),
    AFMOE: lambda path, seed: engine_helpers.make_afmoe_checkpoint(path, seed=seed),
    COHERE2_MOE: lambda path, seed: engine_helpers.make_cohere2_moe_checkpoint(path, seed=seed),
    STEP3P7: lambda path, seed: engine_helpers.make_step3p7_checkpoint(path, seed=seed),
    HY_V3: lambda path, seed: engine_helpers.make_hy_v3_checkpoint(path, seed=seed),
    MISTRAL4: lambda path, seed: engine_helpers.make_mistral4_checkpoint(path, seed=seed),
    LAGUNA: lambda path, seed: engine_helpers.make_laguna_checkpoint(path, seed=seed),
    AXK1: lambda path, seed: engine_helpers.make_axk1_checkpoint(path, seed=seed),
    MELLUM: lambda path, seed: engine_helpers.make_mellum_checkpoint(path, seed=seed),
    FLINT: lambda path, seed: engine_helpers.make_flint_checkpoint(path, seed=seed),
    KOLIBRI1: lambda path, seed: engine_helpers.make_kolibri1_checkpoint(path, seed=seed),
    SARVAM_MLA: lambda path, seed: engine_helpers.make_sarvam_checkpoint(path, "MLA", seed=seed),
    SARVAM_MOE: lambda path, seed: engine_helpers.make_sarvam_checkpoint(path, "MoE", seed=seed),
    EXAONE_MOE: lambda path, seed: engine_helpers.make_exaone_moe_checkpoint(path, seed=seed),
    PHIMOE: lambda path, seed: engine_helpers.make_phimoe_checkpoint(path, seed=seed),
    HUNYUAN: lambda path, seed: engine_helpers.make_hunyuan_checkpoint(path, seed=seed),
    DEEPSEEK_V32: lambda path, seed: engine_helpers.make_deepseek_v32_checkpoint(path, seed=seed),
    QWEN3_5_MOE: lambda path, seed: make_qwen3_5_moe_checkpoint(path, seed=seed, wrapper=True),
}


def make_model(path: Path, arch: str, seed: int = 0) -> str:
    maker = MAKERS.get(arch)
    if maker is None:
        make_checkpoint(path, arch, seed=seed)
    else:
        maker(path, seed)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [arch]
    return str(path)
