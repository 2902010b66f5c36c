"""The SGLang releases the sglang profile answers for, as data: each release is its predecessor plus what changed.

The profile's rules (service/rules/sglang.py) read one `Release`: the tables and words that differ between
releases live here, read from each release's wheel (`pip download --no-deps sglang==X`, paths under `sglang/srt/`)
and held to that release's own code by its conformance grid (tests/data/sglang_<release>_grid.jsonl.gz). Adding a
release: README, "Following SGLang releases".

`words` are SGLang's own messages for the checks its start-up (and its loader) fails, by check; a check a release
does not make has no words there (`None` removes an inherited one). Templates take their values by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from loadplan.errors import NotFound


@dataclass(frozen=True)
class Release:
    version: str
    # layers/moe/utils.py: the loader's shared-experts step (the SGLang adapter hooks it)
    loader_step: str
    # layers/moe/utils.py: MoeA2ABackend (CUSTOMIZED is a plugin hook, not a backend a fleet names)
    a2a_backends: tuple[str, ...]
    # layers/moe/utils.py: MoeRunnerBackend
    moe_runner_backends: tuple[str, ...]
    # layers/quantization/__init__.py: BASE_QUANTIZATION_METHODS, in its order ("mxfp4" follows on CUDA and gfx95)
    quantization_methods: tuple[str, ...]
    # configs/moe_model_registry.py: the architectures (config.json's first) validated for DeepEP v2
    deepep_v2_archs: frozenset[str]
    # arg_groups/moe_hook.py: validate_flashinfer_megamoe_model's validated architectures
    flashinfer_megamoe_archs: frozenset[str]
    # arg_groups/moe_hook.py: handle_moe_kernel_config's quantizations of the trtllm-routed runner (SGLang's spelling)
    trtllm_routed_quants: frozenset[str | None]
    # per MoE block, the a2a backends its forward takes the dispatch/combine branch for (models/*.py)
    dispatch_branch: Mapping[str, frozenset[str]]
    # the model overrides of server arguments this release has (arg_groups/model_overrides/*.py)
    overrides: frozenset[str]
    # entry classes this release registers no model for (models/registry.py): it runs transformers' own model
    # through TransformersMoEForCausalLM, whose decisions the profile does not restate
    unregistered: frozenset[str] = frozenset()
    # the transformers release the wheel pins, as far as its config loading refuses a checkpoint: the model types
    # its CONFIG_MAPPING lacks (of the families the registry plans), and configuration_utils.ALLOWED_LAYER_TYPES
    # where its config validator checks them (None: not restated)
    unknown_model_types: frozenset[str] = frozenset()
    allowed_layer_types: tuple[str, ...] | None = None
    # overrides.py: _moe_runner_backend_quant_constraints keeps an asked triton runner for MXFP8 on any ROCm GPU
    mxfp8_keeps_rocm_triton: bool = True
    words: Mapping[str, str] = field(default_factory=dict)

    def then(self, version: str, *, words: Mapping[str, str | None] | None = None,
             dispatch_branch: Mapping[str, frozenset[str]] | None = None, **changes) -> "Release":
        """The next release: this one, with what `version` changed."""
        merged = {**self.words, **(words or {})}
        return replace(self, version=version, words={k: v for k, v in merged.items() if v is not None},
                       dispatch_branch={**self.dispatch_branch, **(dispatch_branch or {})}, **changes)

    def say(self, check: str, **values) -> str | None:
        """SGLang's words for a failed `check`, or None where this release does not make it."""
        template = self.words.get(check)
        return None if template is None else template.format(**values)


_QUANTIZATIONS = ("fp8", "mxfp8", "blockwise_int8", "modelopt", "modelopt_fp8", "modelopt_fp4", "nvfp4_online",
                  "modelopt_mixed", "w8a8_int8", "w8a8_fp8", "awq", "awq_marlin", "bitsandbytes", "gguf", "gptq_marlin",
                  "moe_wna16", "compressed-tensors", "w4afp8", "petit_nvfp4", "quark", "quark_mxfp4", "auto-round",
                  "auto-round-int8", "modelslim", "quark_int4fp8_moe", "humming", "mxfp_w4a8")
_MEGAMOE_ARCHS = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                            "DeepseekV4ForCausalLM", "Glm4MoeForCausalLM", "NemotronHForCausalLM",
                            "NemotronHPuzzleForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})
_A2A = ("none", "deepep", "mooncake", "nixl", "mori", "ascend_fuseep", "ascend_tp", "flashinfer", "megamoe",
        "deepep_v2", "pplx", "flashinfer_megamoe")
_EVERY_A2A = frozenset(_A2A) - {"none", "ascend_tp"}

# SGLang 0.5.20, the oldest release profiled: every table in full.
SGLANG_0_5_20 = Release(
    version="0.5.20",
    loader_step="install_shared_experts_fusion_decision",
    a2a_backends=_A2A,
    moe_runner_backends=("auto", "triton", "triton_kernel", "deep_gemm", "flashinfer_trtllm",
                         "flashinfer_trtllm_routed", "flashinfer_cutlass", "flashinfer_mxfp4", "flashinfer_cutedsl",
                         "flashinfer_megamoe", "experimental_sgl_trtllm", "cutlass", "marlin", "aiter"),
    quantization_methods=_QUANTIZATIONS,
    deepep_v2_archs=frozenset({"DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "Qwen3MoeForCausalLM"}),
    flashinfer_megamoe_archs=_MEGAMOE_ARCHS,
    trtllm_routed_quants=frozenset({None, "fp8", "mxfp8", "modelopt_fp4", "modelopt_mixed", "nvfp4_online"}),
    dispatch_branch={
        "deepseek": _EVERY_A2A - {"pplx", "megamoe"},                      # models/deepseek_v2.py: DeepseekV2MoE
        "glm4_moe": _EVERY_A2A - {"pplx", "deepep_v2", "megamoe"},         # models/glm4_moe.py
        "qwen2_moe": frozenset({"deepep", "deepep_v2", "mori"}),              # models/qwen2_moe.py
        "qwen3_moe": _EVERY_A2A - {"nixl", "flashinfer", "megamoe"},       # models/qwen3_moe.py
        "minimax_m3": frozenset({"deepep"}),                # models/minimax_m3.py: is_deepep() -> forward_deepep
        "dots3": frozenset({"deepep"}),                     # models/dots3_common/modeling.py: only when is_deepep()
        "minimax_m2": frozenset({"deepep", "ascend_fuseep"}),          # models/minimax_m2.py: MiniMaxM2MoE.forward
        "exaone_moe": frozenset({"deepep"}),                           # models/exaone_moe.py
        "mimo_v2": frozenset({"deepep", "deepep_v2", "mooncake", "mori", "pplx", "ascend_fuseep"}),  # mimo_v2.py
        "step3p5": frozenset({"deepep", "ascend_fuseep"}),             # models/step3p5.py: Step3p5MoEMLP.forward
        "glm4_moe_lite": frozenset({"deepep", "mooncake"}),            # models/glm4_moe_lite.py: _enable_a2a_moe
    },
    overrides=frozenset(),
    unregistered=frozenset({"ExaoneMoeForCausalLM",           # models/exaone_moe.py registers ExaoneMoEForCausalLM
                            "MiniCPMV4_7ForConditionalGeneration"}),
    unknown_model_types=frozenset({"mimo_v2_flash", "granitemoe_swa"}),    # transformers 5.12.1
    allowed_layer_types=("full_attention", "sliding_attention", "chunked_attention", "compressed_sparse_attention",
                         "heavily_compressed_attention", "minimax_m3_sparse", "linear_attention", "conv", "mamba",
                         "attention", "sparse", "dense", "hybrid", "moe", "deepseek_sparse_attention"),
    mxfp8_keeps_rocm_triton=False,
    words={
        # transformers: AutoConfig (models/auto/configuration_auto.py) and PretrainedConfig.validate_layer_type
        "config.model_type": "The checkpoint you are trying to load has model type `{model_type}` but Transformers "
                             "does not recognize this architecture. This could be because of an issue with the "
                             "checkpoint, or because your version of Transformers is out of date.\n\nYou can update "
                             "Transformers with the command `pip install --upgrade transformers`. If this does not "
                             "work, and the checkpoint is very new, then there may not be a release version that "
                             "supports this model yet. In this case, you can get the most up-to-date code by "
                             "installing Transformers from source with the command `pip install "
                             "git+https://github.com/huggingface/transformers.git`",
        "config.layer_types": "Class validation error for validator 'validate_layer_type':\n    ValueError: The "
                              "`{field}` entries must be in {allowed} but got {layers}",
        # configs/model_config.py: _verify_quantization
        "quantization.unknown": "Unknown quantization method: {q}. Must be one of {known}.",
        "quantization.rocm": "{q} quantization is currently not supported in ROCm.",
        # arg_groups/moe_hook.py: handle_moe_kernel_config
        "cutlass.quantization": "Invalid quantization '{q}'. \nFlashInfer Cutlass MOE supports only: 'modelopt_fp4', "
                                "'modelopt_fp8', 'modelopt_mixed', or bfloat16 (None).",
        "kernel.ep": "The expert parallel size must be 1 or the same as the tensor parallel size",
        "cutedsl.quantization": "Invalid quantization '{q}'. \nFlashInfer CuteDSL MOE currently supports only: "
                                "'modelopt_fp4', 'modelopt_mixed' (with NVFP4 MoE layers), 'nvfp4_online', or hybrid "
                                "NVFP4 models.",
        "cutedsl.a2a": "flashinfer_cutedsl supports moe_a2a_backend='none', 'deepep', or 'flashinfer', got '{a2a}'.",
        "trtllm.quantization": "Invalid quantization '{q}'. \nFlashInfer TRTLLM MOE supports only: 'modelopt_fp4', "
                               "'nvfp4_online', 'fp8', 'modelopt_fp8', 'modelopt_mixed', 'compressed-tensors', or "
                               "bfloat16 (None).",
        "trtllm_routed.quantization": "Invalid quantization '{q}'. \nFlashInfer TRTLLM routed MOE supports only: "
                                      "'fp8', 'mxfp8', 'modelopt_fp4', 'modelopt_mixed', 'nvfp4_online', or "
                                      "bfloat16 (None).",
        # arg_groups/moe_hook.py: handle_a2a_moe
        "flashinfer_megamoe.arch": "FlashInfer MegaMOE is not validated for model architectures {archs}. Supported "
                                   "architectures: {supported}.",
        "flashinfer_megamoe.quantization": "FlashInfer MegaMOE currently supports only MXFP8, ModelOpt NVFP4, "
                                           "FP4-expert, or hybrid NVFP4 MoE checkpoints; got quantization={q!r}. "
                                           "Standard FP8 MoE checkpoints are not supported.",
        "flashinfer_megamoe.attn_dp": "FlashInfer MegaMOE is only supported with dp_size == tp_size and "
                                      "--enable-dp-attention",
        "flashinfer_megamoe.runner": "FlashInfer MegaMOE a2a backend requires --moe-runner-backend flashinfer_megamoe",
        "flashinfer_megamoe.device": "FlashInfer MegaMOE currently requires an SM100-family CUDA device for all "
                                     "supported quantization formats.",
        "deepep_v2.arch": "DeepEP v2 MoE is not validated for {arch!r}; supported architectures are {supported}. "
                          "Other model workflows may require an all-reduce after A2A combine. Use --moe-a2a-backend "
                          "deepep.",
        "deepep_v2.runner": "DeepEP v2 MoE currently supports only --moe-runner-backend deep_gemm. Got {runner!r}. Add a "
                            "runner adapter before enabling DeepEP v2 with other MoE runners.",
        "deepep_v2.overlap": "DeepEP v2 MoE has not implemented the TBO/SBO overlap hooks yet. Disable "
                             "--enable-two-batch-overlap and --enable-single-batch-overlap when using --moe-a2a-backend "
                             "deepep_v2.",
        "deepep_v2.enforce": "DeepEP v2 MoE has not validated fused shared experts yet. Remove "
                             "--enforce-shared-experts-fusion when using --moe-a2a-backend deepep_v2.",
        "flashinfer.attn_dp": "Flashinfer MoE A2A is only supported with dp_size == tp_size and --enable-dp-attention",
        "flashinfer.runner": "FlashInfer MoE A2A is supported with flashinfer_cutlass, flashinfer_cutedsl, "
                             "flashinfer_trtllm, flashinfer_trtllm_routed, or deep_gemm.",
        "pplx.attn_dp": "moe_a2a_backend='pplx' requires --enable-dp-attention with at least 2 DP groups (--dp-size "
                        ">= 2).",
        "pplx.runner": "moe_a2a_backend='pplx' is only supported with --moe-runner-backend deep_gemm (or auto).",
        # layers/moe/utils.py: initialize_moe_config
        "sbo.sm90": "SBO (single batch overlap) is not supported on SM90 GPUs with latest sgl-deep-gemm wheel. Please "
                    "try removing --enable-single-batch-overlap argument.",
        # model_loader/loader.py: _get_quantization_config
        "quantization.capability": "The quantization method {q} is not supported for the current GPU. Minimum "
                                   "capability: {need}. Current capability: {have}.",
        # models/deepseek_common/deepseek_weight_loader.py, glm4_moe*.py: the NextN draft's loader
        "nextn.layers": "Only 1 nextn layer is supported",
    },
)
SGLANG_0_5_21 = SGLANG_0_5_20.then(
    "0.5.21",
    # configs/moe_model_registry.py: architectures register for DeepEP v2
    deepep_v2_archs=frozenset({"DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "Qwen3MoeForCausalLM",
                               "Glm5NextForConditionalGeneration", "GlmMoeDsaForCausalLM", "MiMoV2ForCausalLM",
                               "MiMoV2FlashForCausalLM"}),
    flashinfer_megamoe_archs=_MEGAMOE_ARCHS | {"GlmMoeDsaForCausalLM"},
    # their blocks' forward_mega_moe
    dispatch_branch={"qwen2_moe": frozenset({"deepep", "deepep_v2", "mori", "megamoe"}),
                     "qwen3_moe": _EVERY_A2A - {"nixl", "flashinfer"}},
    mxfp8_keeps_rocm_triton=True,
    words={
        # arg_groups/mega_moe_hook.py: check_mega_moe_compat
        "megamoe.overlap": "--moe-a2a-backend megamoe has no two-batch / single-batch overlap decomposition; disable "
                           "--enable-two-batch-overlap and --enable-single-batch-overlap.",
        "megamoe.device": "--moe-a2a-backend megamoe needs a CUDA SM90 GPU (block-FP8 experts) or an SM100-class GPU "
                          "(MXFP4 / NVFP4 experts); it runs DeepGEMM kernels over CUDA symmetric memory. On ROCm, set "
                          "SGLANG_AMD_USE_FLYDSL_MEGA_MOE=1 to select aiter MegaMoEv2 instead.",
        "deepep_v2.arch": "DeepEP v2 MoE is not validated for {arch!r}. The model package must register its "
                          "architecture with register_deepep_v2_model, because its combine and post-expert reduction "
                          "semantics must be validated first.",
    })
SGLANG_0_5_22 = SGLANG_0_5_21.then(
    "0.5.22",
    unregistered=frozenset({"MiniCPMV4_7ForConditionalGeneration"}),
    unknown_model_types=frozenset(), allowed_layer_types=None,        # transformers 5.19.0
    # the attention-DP checks read --attn-dp-size
    words={
        "flashinfer_megamoe.attn_dp": "FlashInfer MegaMOE is only supported with --attn-dp-size equal to --tp-size",
        "flashinfer.attn_dp": "Flashinfer MoE A2A is only supported with --attn-dp-size equal to --tp-size",
        "pplx.attn_dp": "moe_a2a_backend='pplx' requires attention DP with at least 2 groups (--attn-dp-size >= 2).",
    })
SGLANG_0_5_23 = SGLANG_0_5_22.then(
    "0.5.23",
    loader_step="resolve_shared_experts_config",
    unregistered=frozenset(),
    # MiniMax-M3.1's NVFP4-packed MXFP8 checkpoints: their quantization, override, runner and device limit
    quantization_methods=_QUANTIZATIONS[:2] + ("minimax_m3_nvfp4",) + _QUANTIZATIONS[2:],
    overrides=frozenset({"minimax_m3_nvfp4"}),
    trtllm_routed_quants=frozenset({None, "fp8", "mxfp8", "modelopt_fp4", "modelopt_mixed", "nvfp4_online",
                                    "minimax_m3_nvfp4"}),
    flashinfer_megamoe_archs=SGLANG_0_5_22.flashinfer_megamoe_archs | {"BeamForCausalLM",
                                                                       "KimiK3ForConditionalGeneration",
                                                                       "KimiK3LinearForCausalLM"},
    dispatch_branch={"qwen2_moe": frozenset({"deepep", "deepep_v2", "mori", "ascend_fuseep", "megamoe"}),
                     # megamoe -> forward_mega_moe
                     "minimax_m3": frozenset({"deepep", "megamoe"})},
    words={
        "m3_nvfp4.a2a": "M3.1 NVFP4 requires --moe-a2a-backend megamoe",
        "m3_nvfp4.routed_a2a": "M3.1 NVFP4 flashinfer_trtllm_routed requires --moe-a2a-backend none or megamoe",
        "trtllm_routed.quantization": "Invalid quantization '{q}'. \nFlashInfer TRTLLM routed MOE supports only: "
                                      "'fp8', 'mxfp8', 'modelopt_fp4', 'modelopt_mixed', 'nvfp4_online', "
                                      "'minimax_m3_nvfp4', or bfloat16 (None).",
        "flashinfer_megamoe.quantization": "FlashInfer MegaMOE currently supports only MXFP8, ModelOpt NVFP4, "
                                           "FP4-expert, hybrid NVFP4 MoE checkpoints, or nvfp4_online with "
                                           "SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16=1; got quantization={q!r}. "
                                           "Standard FP8 MoE checkpoints are not supported.",
        "flashinfer.attn_dp": "Flashinfer MoE A2A requires --attn-dp-size equal to --tp-size, except for Muse Spark "
                              "TP4/EP4 or TP8/EP8 prefill sequence parallelism.",
    })

RELEASES: dict[str, Release] = {r.version: r for r in (SGLANG_0_5_20, SGLANG_0_5_21, SGLANG_0_5_22, SGLANG_0_5_23)}
NEWEST = SGLANG_0_5_23


def release(version: str) -> Release:
    """The profiled release `version` ("" is the newest); NOT_FOUND naming the profiled releases otherwise."""
    if not version:
        return NEWEST
    if version not in RELEASES:
        raise NotFound("runtime.engine_version of sglang", version[:64], tuple(RELEASES), field="runtime.engine_version")
    return RELEASES[version]
