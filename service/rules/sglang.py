"""The SGLang 0.5.23 profile (DESIGN 8.1): data and small gates restating SGLang's own decision code.

Each table names the SGLang source it restates (paths under `sglang/srt/` of the 0.5.23 wheel). The conformance
recording of i30's oracle (SGLang's code run on a CPU) is the check: tests/conformance.

What a resolve reads here, in SGLang's order:
1. `rewrite`: server-args resolution (`arg_groups/overrides.py`, `arg_groups/model_overrides/*`): the a2a backend
   (`ascend_tp` -> `none`), ep_size (= tp for every EP-spanning backend), the MoE runner (SM100's auto runner),
   and the fusion switch (flashinfer a2a, deepep_v2 and some runners force it off). Each rewritten value becomes a
   decision with SGLang's reason.
2. `refuse`: what SGLang refuses to start with (FAILED_PRECONDITION naming the flag and SGLang's reason).
3. `fusion`: `resolve_shared_experts_config(model_class, hf_config, quant_config)` with the family's gate
   (`GATES`), a family without a gate never fusing.
4. `forward`: the family MoE block's branch (`DISPATCH_BRANCH`), and whether the experts' output is complete
   (`COMPLETE_COMBINE`, `layers/moe/utils.py: post_experts_output_is_complete`).
5. pipeline tiling (`distributed/utils.py: get_pp_indices`: the last stages take the leftover layers) and EPLB
   (the model runner gives a draft worker no EPLB manager).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable

from loadplan.errors import FailedPrecondition, InvalidArgument, NotFound
from loadplan.layouts import MoeLayout, ernie_moe_span, interleaved_moe_layers, layer_flags, layer_numbers
from .backends import Forward
from .devices import Device
from .quantization import Quantization
from .sglang_releases import Release

NAME = "sglang"
# The decision that records the MoE runner SGLang's resolution leaves (on every sglang plan).
RUNNER_KEY = "sglang.moe_runner_backend"

# arg_groups/overrides.py: _A2A_EP_SPANNING_BACKENDS: every one forces ep_size = tp_size.
EP_SPANNING = frozenset({"megamoe", "deepep", "deepep_v2", "mooncake", "nixl", "ascend_fuseep", "flashinfer",
                         "flashinfer_megamoe", "mori", "pplx"})
# layers/moe/utils.py: is_deepep_class_backend.
DEEPEP_CLASS = frozenset({"deepep", "deepep_v2", "mooncake", "mori", "pplx"})
# layers/moe/utils.py: post_experts_output_is_complete: these combines sum each token's expert outputs back to its
# source rank (inside the experts layer), so no reduction is owed after them.
COMPLETE_COMBINE = frozenset({"flashinfer", "pplx", "flashinfer_megamoe"})
# arg_groups/overrides.py: _a2a_fusion_adjustments (flashinfer, flashinfer_megamoe; deepep_v2: "not validated").
A2A_FORCES_FUSION_OFF = {
    "flashinfer": "Flashinfer MoE A2A is enabled. --disable-shared-experts-fusion is automatically set.",
    "flashinfer_megamoe": "Flashinfer MoE A2A is enabled. --disable-shared-experts-fusion is automatically set.",
    "deepep_v2": "Fused shared experts are not validated with DeepEP v2.",
}
# arg_groups/overrides.py: the runner's fusion adjustment.
RUNNER_FORCES_FUSION_OFF = {
    "flashinfer_cutedsl": "FlashInfer CuteDSL MoE is enabled. --disable-shared-experts-fusion is automatically set.",
    "flashinfer_trtllm": "FlashInfer TRTLLM MoE is enabled. --disable-shared-experts-fusion is automatically set.",
    "experimental_sgl_trtllm": "FlashInfer TRTLLM MoE is enabled. --disable-shared-experts-fusion is automatically "
                               "set.",
    "flashinfer_trtllm_routed": "FlashInfer TRTLLM routed MoE is enabled. --disable-shared-experts-fusion is "
                                "automatically set.",
}

@dataclass(frozen=True)
class Shape:
    """SGLang's parallel sizes: its tp is the whole group (loadplan's tp x ep), attention DP is loadplan's dp."""

    tp: int
    ep: int
    attn_dp: int

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep if self.ep and self.tp % self.ep == 0 else 1


@dataclass(frozen=True)
class Inputs:
    """A request as SGLang's resolution leaves it."""

    entry_class: str             # the class SGLang builds (the outermost one: its gate delegates)
    architecture: str            # hf_config.architectures[0] the gate compares (the inner config's for a wrapper)
    layout: MoeLayout
    quantization: Quantization
    device: Device
    a2a: str
    runner: str
    shape: Shape
    sbo: bool
    tbo: bool
    disable_fusion: bool
    enforce_fusion: bool
    draft: bool
    quant_blocks_fusion: bool    # Quark excluding the shared expert (can_fuse_shared_expert() false)
    w4a16: bool                  # w4afp8 / wint4afp8 / compressed-tensors W4A16
    server_quantization: str | None   # --quantization as server-args resolution leaves it (SGLang's spelling)
    # False where a wrapper's hooks do not speak for its nested config (NESTED_GATES): gate None, 0 fusable
    nested_gate_speaks: bool = True
    # A block that decides its own fusion (BLOCK_FUSION): its shared experts as it counts them, and whether one is as
    # wide as a routed expert
    block_shared: int = 0
    block_widths_fit: bool = False
    ep_asked: int = 1             # --ep-size as given, before an EP-spanning backend set it to the tp group
    a2a_asked: str = "none"       # --moe-a2a-backend as handle_moe_kernel_config reads it (before handle_a2a_moe)
    architectures: tuple[str, ...] = ()   # the checkpoint's config.json architectures, as SGLang's hooks read them
    checkpoint_quantization: str | None = None   # the checkpoint's quantization before a model override renamed it
    release: Release | None = None            # the SGLang release that decides (sglang_releases.py)
    model_type: str = ""                      # config.json's model_type, as transformers' AutoConfig reads it
    layer_types: tuple[tuple[str, Any], ...] = ()   # its layer_types / mlp_layer_types, as its validator reads them
    use_aiter: bool = False                   # SGLANG_USE_AITER as SGLang reads it (engine_inputs.py)


@dataclass(frozen=True)
class Rewrite:
    key: str
    value: Any
    reason: str


# --- 1. input rewrites --------------------------------------------------------------------------------------------

# arg_groups/overrides.py: _DEEPSEEK_FAMILY_ARCHS (SM100's auto runner for the DeepSeek family).
DEEPSEEK_FAMILY_ARCHS = frozenset({"DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
                                   "MistralLarge3ForCausalLM", "PixtralForConditionalGeneration",
                                   "GlmMoeDsaForCausalLM", "Glm5NextForConditionalGeneration", "HYV4ForCausalLM",
                                   "HYV4ForCausalLMNextN", "LongcatFlashForCausalLM", "LongcatFlashForCausalLMNextN",
                                   "Dots3NoteForCausalLM"})


@dataclass(frozen=True)
class Sm100Runner:
    """A family override's MoE runner on SM100 for --moe-runner-backend auto (arg_groups/overrides.py,
    model_overrides/*.py)."""

    quants: frozenset             # the quantizations it picks `runner` for (SGLang's key; None: unquantized)
    runner: str = "flashinfer_trtllm"
    only_without_a2a: bool = True         # only under --moe-a2a-backend none, as the flag gave it
    copies_quantization: bool = False     # it writes the checkpoint's quant_method into --quantization
    why: str = "Use flashinfer_trtllm as MoE runner backend on sm100 for {arch}"


SM100_RUNNERS = {
    "deepseek": Sm100Runner(frozenset({None, "fp8", "modelopt_fp8", "modelopt_fp4", "modelopt_mixed", "kimi_int4"}),
                            copies_quantization=True),
    # overrides.py: LongCat's top-k spans its zero-expert logits, which trtllm-gen's fused routing cannot see
    "longcat_flash": Sm100Runner(frozenset(), copies_quantization=True),
    "glm4_moe": Sm100Runner(frozenset({None, "modelopt_fp4"}), copies_quantization=True),   # model_overrides/glm4_moe.py
    "qwen3_moe": Sm100Runner(frozenset({None, "fp8", "modelopt_fp4", "modelopt_mixed"}),    # .../qwen3_moe.py
                             copies_quantization=True),
    # model_overrides/mimo_v2.py: for FP8 checkpoints (not those with MXFP4 experts, which it gives flashinfer_mxfp4)
    "mimo_v2": Sm100Runner(frozenset({"fp8"}), why="MiMoV2 on SM100: moe_runner_backend=flashinfer_trtllm."),
    "minimax_m2": Sm100Runner(frozenset({"modelopt_fp4"}), "flashinfer_trtllm_routed", only_without_a2a=False,
                              why="Use flashinfer_trtllm_routed as MoE runner backend on SM10X for {arch} with "
                                  "modelopt_fp4."),                                    # model_overrides/minimax_m2.py
    # model_overrides/cohere2_moe.py: for unquantized checkpoints (not restated: its NVFP4-pack one)
    "cohere2_moe": Sm100Runner(frozenset({None}), only_without_a2a=False,
                               why="Command-A-Plus on SM10X: moe_runner_backend=flashinfer_trtllm (trtllm-gen fused "
                                   "MoE)."),
}
# The architectures each override registers (the config's first).
SM100_RUNNER_FAMILY = {**dict.fromkeys(DEEPSEEK_FAMILY_ARCHS, "deepseek"),
                       **dict.fromkeys(("LongcatFlashForCausalLM", "LongcatFlashForCausalLMNextN"), "longcat_flash"),
                       "Glm4MoeForCausalLM": "glm4_moe",
                       # model_overrides/qwen3_moe.py: _qwen3_moe_family_overrides registers these architectures
                       **dict.fromkeys(("Qwen3MoeForCausalLM", "Qwen3VLMoeForConditionalGeneration",
                                        "Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration"), "qwen3_moe"),
                       # a NextN / MTP draft runs on the server's runner, which its target's override picked
                       "DeepseekV3ForCausalLMNextN": "deepseek", "GlmMoeDsaForCausalLMNextN": "deepseek",
                       "Glm4MoeForCausalLMNextN": "glm4_moe", "Qwen3NextForCausalLMMTP": "qwen3_moe",
                       "Qwen3_5ForCausalLMMTP": "qwen3_moe",
                       **dict.fromkeys(("MiMoV2ForCausalLM", "MiMoV2FlashForCausalLM"), "mimo_v2"),
                       "MiniMaxM2ForCausalLM": "minimax_m2",
                       **dict.fromkeys(("Cohere2MoeForCausalLM", "Cohere2VisionForConditionalGeneration"), "cohere2_moe")}


def sm100_runner(entry_class: str) -> Sm100Runner | None:
    return SM100_RUNNERS.get(SM100_RUNNER_FAMILY.get(entry_class))


# model_overrides/nemotron_h.py registers these. Restated: its runner default for an unquantized or ModelOpt
# checkpoint; not its W4A16 (marlin) and expert-remap (EPLB on SM100: flashinfer_trtllm_routed) branches.
NEMOTRON_H_ARCHS = frozenset({"NemotronHForCausalLM", "NemotronHPuzzleForCausalLM", "NemotronH_Omni_Reasoning_V3"})
# model_overrides/minimax_m3.py registers these.
MINIMAX_M3_ARCHS = frozenset({"MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration"})


def minimax_m3_quantization(q: Quantization, qconfig: dict | None) -> Quantization:
    """model_overrides/minimax_m3.py: _resolve_quant_method: an MXFP8 checkpoint whose experts are NVFP4-packed
    (moe_quant_algo NVFP4, moe_quant_format nvfp4-pack-quantized) is served as minimax_m3_nvfp4."""
    qconfig = qconfig if isinstance(qconfig, dict) else {}
    if (q.name == "mxfp8" and str(qconfig.get("moe_quant_algo", "")).upper() == "NVFP4"
            and qconfig.get("moe_quant_format") == "nvfp4-pack-quantized"):
        return replace(q, name="minimax_m3_nvfp4")
    return q


def _minimax_m3_override(quant: str | None, a2a: str, runner: str, device: Device, done: list[Rewrite],
                         release: Release) -> tuple[str, str]:
    """model_overrides/minimax_m3.py: _minimax_m3_overrides, its MoE runner and a2a backend (not its attention, page
    size and KV-cache settings, nor its DSPARK / DFLASH speculation checks)."""
    def use(key: str, value: str, why: str) -> str:
        done.append(Rewrite(f"sglang.{key}", value, why))
        return value

    blackwell = device.kind == "cuda" and device.capability is not None and device.capability[0] in (10, 11, 12)
    if quant == "minimax_m3_nvfp4":
        if not blackwell:
            if runner == "auto":
                runner = use("moe_runner_backend", "marlin", "M3.1 NVFP4 off Blackwell: the marlin MoE runner")
            return a2a, runner
        if a2a not in ("none", "megamoe"):
            raise FailedPrecondition(f"runtime.a2a_backend: SGLang {release.version} refuses to start: "
                                     + release.say("m3_nvfp4.routed_a2a" if runner == "flashinfer_trtllm_routed"
                                                   else "m3_nvfp4.a2a"))
        if runner != "flashinfer_trtllm_routed":
            if a2a != "megamoe":
                a2a = use("moe_a2a_backend", "megamoe", "M3.1 NVFP4 on Blackwell runs --moe-a2a-backend megamoe")
            if runner == "auto":
                runner = use("moe_runner_backend", "deep_gemm", "M3.1 NVFP4 on Blackwell: the deep_gemm MoE runner")
        return a2a, runner
    if runner == "auto" and quant == "mxfp8" and device.kind == "hip":
        runner = use("moe_runner_backend", "triton", "MiniMax-M3 MXFP8 on ROCm: the triton MoE runner")
    elif runner == "auto" and quant == "mxfp8" and is_sm100(device):
        runner = use("moe_runner_backend", "deep_gemm", "MiniMax-M3 MXFP8 on SM100: the deep_gemm MoE runner")
    elif runner == "auto" and quant == "modelopt_mixed" and is_sm100(device):
        runner = use("moe_runner_backend", "flashinfer_trtllm_routed",
                     "MiniMax-M3 ModelOpt mixed precision on SM100: the flashinfer_trtllm_routed MoE runner")
    if quant is None and runner in ("auto", "deep_gemm"):
        runner = use("moe_runner_backend", "triton", "MiniMax-M3: the deep_gemm MoE runner produces corrupted output "
                                                     "on bf16 full weights; overriding --moe-runner-backend to 'triton'.")
    return a2a, runner


def is_sm100(device: Device) -> bool:
    return device.kind == "cuda" and device.capability is not None and device.capability[0] == 10


def is_sm90(device: Device) -> bool:
    return device.kind == "cuda" and device.capability is not None and device.capability[0] == 9


# arg_groups/choices.py: MXFP8_MOE_RUNNER_BACKEND_CHOICES.
MXFP8_RUNNERS = ("cutlass", "deep_gemm", "flashinfer_megamoe", "flashinfer_trtllm", "flashinfer_trtllm_routed")


def _quantization_runner(server_q: str | None, runner: str, a2a: str, device: Device, done: list[Rewrite],
                         release: Release) -> str:
    """arg_groups/overrides.py: _moe_runner_backend_quant_constraints (run by handle_moe_kernel_config): an MXFP8
    --quantization takes its own runners, a ModelOpt FP4 one flashinfer_cutlass on SM110/SM120. Not restated:
    nvfp4_online (an online quantization a checkpoint does not name) and ROCm's aiter runner (SGLANG_USE_AITER)."""
    gfx95 = device.kind == "hip" and device.capability is not None and device.capability >= (9, 5)
    if server_q == "mxfp8":
        rocm_triton = release.mxfp8_keeps_rocm_triton and device.kind == "hip" and runner == "triton"
        allowed = [*MXFP8_RUNNERS, *(("triton",) if gfx95 or rocm_triton else ())]
        default = ("flashinfer_megamoe" if a2a == "flashinfer_megamoe" else "triton" if gfx95
                   else "flashinfer_trtllm")
        if runner == "auto" or runner not in allowed:
            done.append(Rewrite("sglang.moe_runner_backend", default,
                                f"mxfp8 quantization supports only {', '.join(allowed)} backends: "
                                f"--moe-runner-backend {runner} -> {default}"))
            return default
    if (runner == "auto" and server_q == "modelopt_fp4" and device.kind == "cuda" and device.capability is not None
            and device.capability[0] in (11, 12)):
        done.append(Rewrite("sglang.moe_runner_backend", "flashinfer_cutlass",
                            "Use flashinfer_cutlass as MoE runner backend on SM110/SM120 for modelopt_fp4 (trtllm-gen "
                            "MoE kernels are SM100-only)"))
        return "flashinfer_cutlass"
    return runner


def rewrite(entry_class: str, quant_key: str | None, a2a: str, runner: str, shape: Shape, device: Device,
            disable_fusion: bool, release: Release, server_quantization: str | None = None,
            fp4_experts: bool = False) -> tuple[str, str, Shape, bool, str, list[Rewrite]]:
    """(a2a, runner, shape, disable_fusion) as SGLang's server-args resolution leaves them, the a2a backend its MoE
    kernel hook reads, and what it rewrote."""
    done: list[Rewrite] = []
    asked = a2a                 # the SM100 runner override reads the a2a backend as the flag gave it
    if entry_class in MINIMAX_M3_ARCHS:
        a2a, runner = _minimax_m3_override(quant_key, a2a, runner, device, done, release)
    if a2a == "ascend_tp":   # layers/moe/token_dispatcher: the Ascend TP dispatcher runs SGLang's normal path
        a2a = "none"
        done.append(Rewrite("sglang.moe_a2a_backend", "none",
                            "SGLang runs --moe-a2a-backend ascend_tp as none (its TP dispatcher is the normal path)"))
    kernel_hook_a2a = a2a       # what handle_moe_kernel_config reads: handle_a2a_moe rewrites after it
    if a2a in EP_SPANNING and shape.ep != shape.tp:
        done.append(Rewrite("sglang.ep_size", shape.tp,
                            f"{a2a} MoE is enabled. The expert parallel size is adjusted from {shape.ep} to the "
                            f"tensor parallel size [{shape.tp}]."))
        shape = Shape(shape.tp, shape.tp, shape.attn_dp)
    if (entry_class == "GptOssForCausalLM" and quant_key == "mxfp4" and runner == "auto" and device.kind == "cuda"
            and device.capability is not None and device.capability[0] in (10, 12)):
        runner = "flashinfer_mxfp4"      # model_overrides/gpt_oss.py
        done.append(Rewrite("sglang.moe_runner_backend", runner, "Detected SM100 and MXFP4 quantization format for "
                                                                 "GPT-OSS model, enabling FlashInfer MXFP4 MOE kernel."))
    if (entry_class in NEMOTRON_H_ARCHS and runner == "auto"
            and (quant_key is None or quant_key.startswith("modelopt"))):
        cap = device.capability if device.kind == "cuda" else None
        if is_sm100(device) and asked == "none":
            runner, why = "flashinfer_trtllm", f"Use flashinfer_trtllm as MoE runner backend on sm100 for {entry_class}"
        elif quant_key in ("modelopt_fp4", "modelopt_mixed") and cap is not None and (8, 0) <= cap < (10, 0):
            runner, why = "marlin", f"Use marlin as MoE runner backend on SM80-SM90 for {entry_class} {quant_key}"
        else:
            runner, why = "flashinfer_cutlass", f"NemotronH's MoE runner default for {entry_class}"
        done.append(Rewrite("sglang.moe_runner_backend", runner, why))
    if (entry_class == "DeepseekV4ForCausalLM" and runner == "auto" and fp4_experts and device.kind == "cuda"
            and asked == "none" and device.capability is not None and device.capability[0] in (9, 10, 12)):
        runner = "flashinfer_mxfp4"     # model_overrides/deepseek_v4.py (not restated: its NVFP4 hybrid checkpoint)
        done.append(Rewrite("sglang.moe_runner_backend", runner,
                            f"Use flashinfer_mxfp4 as MoE runner backend for {entry_class}."))
    row = sm100_runner(entry_class)
    if (row is not None and is_sm100(device) and runner == "auto" and quant_key in row.quants
            and (asked == "none" or not row.only_without_a2a)):
        runner = row.runner
        done.append(Rewrite("sglang.moe_runner_backend", runner, row.why.format(arch=entry_class)))
    runner = _quantization_runner(server_quantization, runner, kernel_hook_a2a, device, done, release)
    why = A2A_FORCES_FUSION_OFF.get(a2a) or RUNNER_FORCES_FUSION_OFF.get(runner)
    if why and not disable_fusion:
        disable_fusion = True
        done.append(Rewrite("sglang.disable_shared_experts_fusion", True, why))
    # arg_groups/moe_hook.py: handle_a2a_moe resolves an auto runner for the backends that need their own (after the
    # runner's fusion adjustment above, which read the runner before it)
    if runner == "auto" and a2a in A2A_RUNNER:
        runner, why = A2A_RUNNER[a2a]
        done.append(Rewrite("sglang.moe_runner_backend", runner, why))
    return a2a, runner, shape, disable_fusion, kernel_hook_a2a, done


# arg_groups/moe_hook.py: handle_a2a_moe's runner for --moe-runner-backend auto, per a2a backend, and its log line.
A2A_RUNNER = {
    "deepep_v2": ("deep_gemm", "DeepEP v2 MoE: resolved --moe-runner-backend auto -> deep_gemm."),
    "pplx": ("deep_gemm", "auto set moe_runner_backend=`deep_gemm` for PPLX EP"),
    "flashinfer_megamoe": ("flashinfer_megamoe", "FlashInfer MegaMOE a2a backend: --moe-runner-backend auto -> "
                                                 "flashinfer_megamoe"),
}


# --- 2. start-up refusals -------------------------------------------------------------------------------------------

# configs/model_config.py: _verify_quantization's rocm_supported_quantization.
ROCM_QUANTIZATIONS = frozenset({"awq", "fp8", "compressed_tensors", "compressed-tensors", "w8a8_fp8", "petit_nvfp4",
                                "quark", "mxfp4", "mxfp8", "auto-round", "auto-round-int8", "quark_int4fp8_moe",
                                "quark_mxfp4"})
# layers/quantization/*.py: get_min_capability, restated for the quantizations whose device limit the conformance
# grid holds (SGLang's own list is longer).
QUANTIZATION_MIN_CAPABILITY = {"mxfp8": (10, 0), "minimax_m3_nvfp4": (9, 0), "modelopt_fp8": (8, 9)}
# How SGLang spells the names loadplan writes with underscores.
SGLANG_SPELLING = {"compressed_tensors": "compressed-tensors", "auto_round": "auto-round",
                   "auto_round_int8": "auto-round-int8"}


def sglang_name(q: str | None) -> str | None:
    """A quantization name as SGLang spells it."""
    return SGLANG_SPELLING.get(q, q) if q is not None else None


def _quantization_methods(device: Device, release: Release) -> list[str]:
    gfx95 = device.kind == "hip" and device.capability is not None and device.capability >= (9, 5)
    return [*release.quantization_methods, *(("mxfp4",) if device.kind == "cuda" or gfx95 else ())]


def _verify_quantization(q: str | None, device: Device, release: Release, no) -> None:
    """configs/model_config.py: ModelConfig._verify_quantization's refusal of `q` (SGLang's spelling)."""
    if q is None:
        return
    known = _quantization_methods(device, release)
    if q not in known:
        no("device", "quantization.unknown", q=q, known=known)
    if device.kind == "hip" and q not in ROCM_QUANTIZATIONS:
        no("device", "quantization.rocm", q=q)


def refuse(i: Inputs) -> None:
    """FAILED_PRECONDITION where SGLang refuses to start, with SGLang's own words for the first check it fails, in the
    order its start-up meets them:
    1. the server-args pipeline (arg_groups/pipeline.py), hook by hook: handle_mega_moe; the model config's
       _verify_quantization (its first model_config_of); the model overrides (model_overrides/minimax_m3.py, in
       `rewrite`); handle_moe_kernel_config; handle_a2a_moe;
    2. the scheduler's initialize_moe_config (layers/moe/utils.py);
    3. the model config of a quantization the overrides renamed (MiniMax-M3's minimax_m3_nvfp4);
    4. the loader's quantization config (model_loader/loader.py: the GPU's minimum capability).
    Not here: the per-rank dispatch-token budgets of MoRI, pplx and DeepEP v2
    (SGLANG_*_NUM_MAX_DISPATCH_TOKENS_PER_RANK against --chunked-prefill-size), buffer sizes that are not plan
    inputs."""
    r = i.release

    def no(flag: str, check: str, **values) -> None:
        words = r.say(check, **values)
        if words is not None:       # None: this release does not make the check
            raise FailedPrecondition(f"runtime.{flag}: SGLang {r.version} refuses to start: {words}")

    overlap = "enable_tbo" if i.tbo else "enable_sbo"
    q = sglang_name(i.checkpoint_quantization)
    server_q = i.server_quantization
    # 1. arg_groups/mega_moe_hook.py: check_mega_moe_compat
    if i.a2a == "megamoe":
        if i.sbo or i.tbo:
            no(overlap, "megamoe.overlap")
        if not (is_sm90(i.device) or is_sm100(i.device) or i.device.kind == "hip"):
            no("a2a_backend", "megamoe.device")
    # the model config's first load (model_config_of): transformers' AutoConfig, then its _verify_quantization
    if i.model_type in r.unknown_model_types:
        no("config", "config.model_type", model_type=i.model_type)
    if r.allowed_layer_types is not None:
        for name, layers in i.layer_types:      # PretrainedConfig.validate_layer_type: stops at the first unset one
            if layers is None:
                break
            if not all(t in r.allowed_layer_types for t in layers):
                no("config", "config.layer_types", field=name, allowed=r.allowed_layer_types, layers=layers)
    _verify_quantization(q, i.device, r, no)
    # arg_groups/moe_hook.py: handle_moe_kernel_config (before handle_a2a_moe sets ep_size to the tp group)
    if i.runner == "flashinfer_cutlass":
        if server_q not in ("modelopt_fp4", "modelopt_fp8", "modelopt_mixed", None):
            no("moe_runner_backend", "cutlass.quantization", q=server_q)
        if i.ep_asked not in (1, i.shape.tp):
            no("moe_runner_backend", "kernel.ep")
    if i.runner == "flashinfer_cutedsl":
        if server_q not in ("modelopt_fp4", "modelopt_mixed", "nvfp4_online"):
            no("moe_runner_backend", "cutedsl.quantization", q=server_q)
        if i.ep_asked not in (1, i.shape.tp):
            no("moe_runner_backend", "kernel.ep")
        if i.a2a_asked not in ("none", "deepep", "flashinfer"):
            no("a2a_backend", "cutedsl.a2a", a2a=i.a2a_asked)
    if i.runner in ("flashinfer_trtllm", "experimental_sgl_trtllm") and server_q not in TRTLLM_QUANTS:
        no("moe_runner_backend", "trtllm.quantization", q=server_q)
    if i.runner == "flashinfer_trtllm_routed" and server_q not in r.trtllm_routed_quants:
        no("moe_runner_backend", "trtllm_routed.quantization", q=server_q)
    # arg_groups/moe_hook.py: handle_a2a_moe
    if i.a2a == "flashinfer_megamoe":
        if not set(i.architectures) & r.flashinfer_megamoe_archs:
            no("a2a_backend", "flashinfer_megamoe.arch", archs=list(i.architectures),
               supported=sorted(r.flashinfer_megamoe_archs))
        if server_q not in ("mxfp8", "modelopt_fp4"):
            no("a2a_backend", "flashinfer_megamoe.quantization", q=server_q)
        if i.shape.attn_dp != i.shape.tp or i.shape.attn_dp < 2:
            no("a2a_backend", "flashinfer_megamoe.attn_dp")
        if i.runner != "flashinfer_megamoe":
            no("moe_runner_backend", "flashinfer_megamoe.runner")
        if not is_sm100(i.device):
            no("a2a_backend", "flashinfer_megamoe.device")
    if i.a2a == "deepep_v2":   # validate_deepep_v2_model_architecture, then the runner, overlap and fusion
        first = i.architectures[0] if i.architectures else None
        if first not in r.deepep_v2_archs:
            no("a2a_backend", "deepep_v2.arch", arch=first, supported=sorted(r.deepep_v2_archs))
        if i.runner != "deep_gemm":
            no("moe_runner_backend", "deepep_v2.runner", runner=i.runner)
        if i.sbo or i.tbo:
            no(overlap, "deepep_v2.overlap")
        if i.enforce_fusion:
            no("enforce_shared_experts_fusion", "deepep_v2.enforce")
    if i.a2a == "flashinfer":
        if i.shape.attn_dp != i.shape.tp or i.shape.attn_dp < 2:
            no("a2a_backend", "flashinfer.attn_dp")
        if i.runner not in FLASHINFER_A2A_RUNNERS:
            no("moe_runner_backend", "flashinfer.runner")
    if i.a2a == "pplx":
        if i.shape.attn_dp < 2:
            no("a2a_backend", "pplx.attn_dp")
        if i.runner != "deep_gemm":
            no("moe_runner_backend", "pplx.runner")
    # 2. layers/moe/utils.py: initialize_moe_config
    if i.sbo and is_sm90(i.device):
        no("enable_sbo", "sbo.sm90")
    # 3. the model config again, of the quantization the model override named
    renamed = sglang_name(i.quantization.name)
    if renamed != q:
        _verify_quantization(renamed, i.device, r, no)
    # 4. model_loader/loader.py: _get_quantization_config
    need = QUANTIZATION_MIN_CAPABILITY.get(i.quantization.name)
    if need is not None and i.device.kind == "cuda" and i.device.capability is not None \
            and i.device.capability < need:
        no("device", "quantization.capability", q=renamed, need=f"{need[0]}{need[1]}",
           have=f"{i.device.capability[0]}{i.device.capability[1]}")


# arg_groups/moe_hook.py: handle_moe_kernel_config's quantizations of the trtllm runners (SGLang's spelling).
TRTLLM_QUANTS = frozenset({None, "modelopt_fp4", "nvfp4_online", "fp8", "mxfp8", "modelopt_fp8", "modelopt_mixed",
                           "compressed-tensors"})
# arg_groups/moe_hook.py: the runners FlashInfer's a2a accepts.
FLASHINFER_A2A_RUNNERS = ("flashinfer_cutlass", "flashinfer_cutedsl", "flashinfer_trtllm", "flashinfer_trtllm_routed",
                          "deep_gemm")


# --- 3. fusion gates (models/*.py: shared_experts_fusion_disable_reason) ----------------------------------------------

def _device_at_least(device: Device, kind: str, need: tuple[int, int]) -> bool:
    return device.kind == kind and device.capability is not None and device.capability >= need


def _cuda80(d: Device) -> bool:
    return _device_at_least(d, "cuda", (8, 0))


def _hip94(d: Device) -> bool:
    return _device_at_least(d, "hip", (9, 4))


def deepseek_gate(i: Inputs, fused_architecture: str) -> str | None:
    """models/deepseek_v2.py: DeepseekV2ForCausalLM.shared_experts_fusion_disable_reason."""
    if i.quant_blocks_fusion:
        return ("Quantization keeps shared experts at a higher precision than the routed experts, so they cannot "
                "be fused into the quantized routed-expert path.")
    if i.enforce_fusion:
        return None
    if i.sbo or i.tbo:
        return "SBO/TBO enabled: incompatible with fusing shared expert into MoE kernel."
    if i.a2a in DEEPEP_CLASS:
        return "DeepEP: fusion off by default (use --enforce-shared-experts-fusion to enable)."
    lay = i.layout
    if (i.architecture != fused_architecture or lay.n_routed not in (256, 384) or lay.n_shared != 1
            or (lay.n_routed == 384 and i.quantization.name != "quark")):
        return "Config does not support fused shared expert(s)."
    if not (_cuda80(i.device) or _hip94(i.device) or _device_at_least(i.device, "musa", (3, 1))):
        return ("Only Deepseek V3/R1 on NV-platform with capability >= 80 or AMD-platform with capability >= "
                "gfx942(MI30x) can use shared experts fusion optimization.")
    if i.shape.ep > 1 and not _hip94(i.device):
        return ("Only Deepseek V3/R1 on AMD-platform with capability >= gfx942(MI30x) can use shared experts "
                "fusion optimization under expert parallelism.")
    if i.w4a16:
        return ("Deepseek V3/R1 W4AFP8/W4A16 model uses different quant method for routed experts and shared "
                "experts.")
    return None


def glm45_gate(i: Inputs, fused_architecture: str) -> str | None:
    """models/glm4_moe.py: Glm4MoeForCausalLM.shared_experts_fusion_disable_reason (reads neither enforce nor
    SBO/TBO)."""
    if not (_cuda80(i.device) or _hip94(i.device)):
        return ("Only GLM-4.5 on NV-platform with capability >= 80 or AMD-platform with capability >= "
                "gfx942(MI30x) can use shared experts fusion optimization.")
    if i.shape.ep > 1 and not _hip94(i.device):
        return ("Only GLM-4.5 on AMD-platform with capability >= gfx942(MI30x) can use shared experts fusion "
                "optimization under expert parallelism.")
    if i.a2a in ("deepep", "mori"):
        return "GLM-4.5 cannot use shared experts fusion optimization under deepep expert parallelism."
    if i.quantization.name == "w4afp8":
        return "GLM-4.5 W4AFP8 model uses different quant method for routed experts and shared experts."
    return None


def glm47_flash_gate(i: Inputs, fused_architecture: str) -> str | None:
    """models/glm4_moe_lite.py: Glm4MoeLiteForCausalLM.shared_experts_fusion_disable_reason (its NextN draft's
    fused architecture is its own, glm4_moe_lite_nextn.py)."""
    if not _cuda80(i.device) or i.architecture != fused_architecture or i.layout.n_shared != 1:
        return ("Only GLM-4.5 or GLM-4.6 on NV-platform with capability >= 80 can use shared experts fusion "
                "optimization.")
    if i.shape.ep > 1:
        return "GLM-4.5 or GLM-4.6 cannot use shared experts fusion optimization under expert parallelism."
    return None


def glm45v_gate(i: Inputs, fused_architecture: str) -> str | None:
    """models/glm4v_moe.py: Glm4vMoeForConditionalGeneration.shared_experts_fusion_disable_reason (the top-level
    n_shared_experts: the grid's configs keep it under text_config, where the layout reads it)."""
    if not _cuda80(i.device):
        return "Only GLM-4.5V on NV-platform with capability >= 80 can use shared experts fusion optimization."
    if i.shape.ep > 1:
        return "GLM-4.5V cannot use shared experts fusion optimization under expert parallelism."
    if i.a2a == "deepep":
        return "GLM-4.5V cannot use shared experts fusion optimization under deepep expert parallelism."
    return None


def minimax_m3_gate(i: Inputs, fused_architecture: str) -> str | None:
    """models/minimax_m3.py: MiniMaxM3SparseForCausalLM.shared_experts_fusion_disable_reason (reads neither enforce
    nor SBO/TBO; num_fusable_shared_experts asserts exactly one shared expert)."""
    if not i.layout.n_shared:
        return "No shared experts are defined in the config."
    if i.quantization.name in ("modelopt_mixed", "minimax_m3_nvfp4"):
        return "Shared and routed experts may use different quantization formats in mixed-precision checkpoints."
    if i.device.kind not in ("cuda", "hip"):
        return "Shared experts fusion currently requires CUDA or ROCm devices."
    if i.device.kind == "cuda" and not _cuda80(i.device):
        return "Shared experts fusion requires SM80 or newer GPUs."
    if i.device.kind == "hip" and not _device_at_least(i.device, "hip", (9, 5)):
        return "Shared experts fusion on ROCm is validated on gfx950 only."
    if i.shape.ep > 1:
        return "Shared experts fusion is not supported together with expert parallelism yet."
    if i.a2a == "deepep":       # MoeA2ABackend.is_deepep(): deepep itself, not the DeepEP class
        return "Shared experts fusion is not supported when Deepep MoE backend is enabled."
    if i.layout.n_shared != 1:
        raise FailedPrecondition(f"runtime.shared_experts_fusion: SGLang {i.release.version} refuses to start: Only 1 fused "
                                 f"shared expert is supported for MiniMax-M3 (n_shared_experts={i.layout.n_shared})")
    return None


def deepseek_v4_gate(i: Inputs, fused_architecture: str) -> str | None:
    """models/deepseek_v4.py: DeepseekV4ForCausalLM.shared_experts_fusion_disable_reason: fuses only when enforced,
    and then with exactly one shared expert (else SGLang raises ValueError at load)."""
    if i.quant_blocks_fusion:
        return ("Quantization keeps shared experts at a higher precision than the routed experts, so they cannot "
                "be fused into the quantized routed-expert path.")
    if i.shape.ep > 1 and i.a2a not in PER_RANK_FUSED_SLOTS:
        return ("Expert parallelism keeps only a slice of the routed experts on each rank, so the fused shared "
                "expert cannot be appended to the routed weight tensor (only DeepEP/MegaMOE per-rank shared slots "
                "support fusion under EP).")
    if not i.enforce_fusion:
        return "Config does not support fused shared expert(s)."
    if i.layout.n_shared != 1:
        raise FailedPrecondition(f"runtime.enforce_shared_experts_fusion: SGLang {i.release.version} refuses to start: "
                                 f"DeepSeek "
                                 f"V4 shared-experts fusion expects exactly one shared expert, but got "
                                 f"n_shared_experts={i.layout.n_shared}.")
    return None


def dots3_gate(i: Inputs, fused_architecture: str) -> str | None:
    """models/dots3_common/modeling.py: Dots3LanguageModelForCausalLM.shared_experts_fusion_disable_reason (asked by
    Dots3NoteForCausalLM with its own config; CUDA only; reads neither enforce, SBO/TBO nor the a2a backend)."""
    lay = i.layout
    if (not _cuda80(i.device) or i.architecture != fused_architecture or lay.n_routed != 256
            or lay.n_shared != 1):
        return "Shared-expert fusion is unsupported for this Dots3 configuration."
    if i.shape.ep > 1:
        return "Dots3 shared-expert fusion is unsupported with expert parallelism."
    if i.quantization.name == "w4afp8":
        return "Dots3 W4AFP8 shared and routed experts use incompatible quantization."
    return None


@dataclass(frozen=True)
class GateRow:
    gate: Callable[[Inputs, str], str | None]
    fused_architecture: str


# The classes SGLang gates (models/*.py), keyed by the entry class SGLang builds. A class not here has no
# shared_experts_fusion_disable_reason: SGLang never fuses it (resolve_shared_experts_config: "fusion requires
# both hooks"). Wrappers ask their inner class's gate with their text config.
GATES: dict[str, GateRow] = {
    "DeepseekV2ForCausalLM": GateRow(deepseek_gate, "DeepseekV3ForCausalLM"),
    "DeepseekV3ForCausalLM": GateRow(deepseek_gate, "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": GateRow(deepseek_gate, "DeepseekV3ForCausalLM"),
    "DeepseekV3ForCausalLMNextN": GateRow(deepseek_gate, "DeepseekV3ForCausalLMNextN"),
    "GlmMoeDsaForCausalLM": GateRow(deepseek_gate, "GlmMoeDsaForCausalLM"),
    "KimiK25ForConditionalGeneration": GateRow(deepseek_gate, "DeepseekV3ForCausalLM"),
    # KimiVL asks DeepSeek-V2's class, whose fused architecture its DeepseekV2 text config never names
    "KimiVLForConditionalGeneration": GateRow(deepseek_gate, "DeepseekV3ForCausalLM"),
    "DotsVLMForCausalLM": GateRow(deepseek_gate, "DeepseekV3ForCausalLM"),
    "DeepseekVL2ForCausalLM": GateRow(deepseek_gate, "DeepseekV3ForCausalLM"),
    "Glm4MoeForCausalLM": GateRow(glm45_gate, "Glm4MoeForCausalLM"),
    "Glm4MoeForCausalLMNextN": GateRow(glm45_gate, "Glm4MoeForCausalLMNextN"),
    "Glm4MoeLiteForCausalLM": GateRow(glm47_flash_gate, "Glm4MoeLiteForCausalLM"),
    "Glm4MoeLiteForCausalLMNextN": GateRow(glm47_flash_gate, "Glm4MoeLiteForCausalLMNextN"),
    "Glm4vMoeForConditionalGeneration": GateRow(glm45v_gate, "Glm4vMoeForConditionalGeneration"),
    "MiniMaxM3SparseForCausalLM": GateRow(minimax_m3_gate, "MiniMaxM3SparseForCausalLM"),
    "DeepseekV4ForCausalLM": GateRow(deepseek_v4_gate, "DeepseekV4ForCausalLM"),
    # dots3_common/modeling.py: fused_shared_experts_architecture = "Dots3NoteForCausalLM"
    "Dots3NoteForCausalLM": GateRow(dots3_gate, "Dots3NoteForCausalLM"),
    # mistral_large_3.py: a DeepseekV3ForCausalLM subclass (its gate, its fused architecture)
    "MistralLarge3ForCausalLM": GateRow(deepseek_gate, "DeepseekV3ForCausalLM"),
    # pixtral.py: asks MistralLarge3ForCausalLM's gate with text_config (see NESTED_GATES)
    "PixtralForConditionalGeneration": GateRow(deepseek_gate, "DeepseekV3ForCausalLM"),
    # deepseek_ocr.py: asks DeepseekV2ForCausalLM's gate with text_config (see NESTED_GATES)
    "DeepseekOCRForCausalLM": GateRow(deepseek_gate, "DeepseekV3ForCausalLM"),
}


def _nested(config: Any, *path: str) -> Any:
    for key in path:
        config = config.get(key) if isinstance(config, Mapping) else None
    return config


@dataclass(frozen=True)
class NestedGate:
    """A wrapper whose hooks speak only for some nested configs: elsewhere its gate answers None and
    num_fusable_shared_experts 0 (never fused)."""

    when: str                                  # SGLang's condition, as its source spells it
    speaks: Callable[[Mapping], bool]             # read from the checkpoint's (outer) config


NESTED_GATES = {
    # pixtral.py: _fused_moe_text_config
    "PixtralForConditionalGeneration": NestedGate(
        "text_config.model_type == 'deepseek_v3'",
        lambda c: _nested(c, "text_config", "model_type") == "deepseek_v3"),
    # deepseek_ocr.py: _fused_moe_text_config, with configs/deepseek_ocr.py: is_ocr2_config (its hf_config.text_config
    # is config.json's language_config: DeepseekVLV2Config)
    "DeepseekOCRForCausalLM": NestedGate(
        "not is_ocr2_config(hf_config) and (text_config.topk_method == 'noaux_tc' or text_config.use_mla)",
        lambda c: not (str(_nested(c, "vision_config", "model_name") or "").lower() == "deepencoderv2"
                       or _nested(c, "projector_config", "input_dim") == 896)
        and (_nested(c, "language_config", "topk_method") == "noaux_tc"
             or bool(_nested(c, "language_config", "use_mla")))),
}


def nested_gate_speaks(entry_class: str, config: Any) -> bool:
    row = NESTED_GATES.get(entry_class)
    return row is None or row.speaks(config if isinstance(config, Mapping) else {})


# The architecture a wrapper's gate compares: models/kimi_vl.py hands its text config over renamed
# DeepseekV2ForCausalLM; the others compare what their nested config names (or the inner class).
WRAPPER_ARCHITECTURE = {"KimiVLForConditionalGeneration": "DeepseekV2ForCausalLM"}


@dataclass(frozen=True)
class BlockFusion:
    """A class whose MoE block decides its own fusion while it is built, whatever resolve_shared_experts_config
    said: the Qwen2-MoE block (models/qwen2_moe.py: Qwen2MoeSparseMoeBlock.__init__), with the flags its builder
    passes. Its other way to fuse is ROCm's aiter: `_use_aiter = get_bool_env_var("SGLANG_USE_AITER") and _is_hip`
    (the runtime's engine_env SGLANG_USE_AITER, default false)."""

    builder: str                  # the module whose decoder layers build the block
    on_cuda: bool                 # enable_cuda_shared_expert_fusion
    refuses_more_than_one: bool   # the model refuses more than one fused shared expert at build


_QWEN3_NEXT_BLOCK = BlockFusion("qwen3_next.py", True, True)
_QWEN3_5_BLOCK = BlockFusion("qwen3_5.py", False, False)
BLOCK_FUSION = {
    "Qwen3NextForCausalLM": _QWEN3_NEXT_BLOCK, "Qwen3NextForCausalLMMTP": _QWEN3_NEXT_BLOCK,
    "Qwen3_5MoeForCausalLM": _QWEN3_5_BLOCK, "Qwen3_5MoeForConditionalGeneration": _QWEN3_5_BLOCK,
    # minicpmv.py builds qwen3_5.py's Qwen3_5MoeForCausalLM for a MoE text config (its hooks ask Qwen3_5ForCausalLM's
    # gate but define no num_fusable_shared_experts: the loader fuses none, the block still decides)
    "MiniCPMV4_6ForConditionalGeneration": _QWEN3_5_BLOCK, "MiniCPMV4_7ForConditionalGeneration": _QWEN3_5_BLOCK,
}


def block_shared(cfg: Any) -> tuple[int, bool]:
    """The Qwen2-MoE block's shared experts as SGLang counts them (models/qwen2_moe.py: get_num_shared_experts:
    n_shared_experts where the config says it, else one for a shared_expert_intermediate_size above 0) and whether
    they fit a routed slot (can_fuse_shared_expert: the two widths equal). `cfg`: the family's ConfigView."""
    width = cfg.int("shared_expert_intermediate_size")
    count = cfg.int("n_shared_experts", minimum=0) if cfg.raw("n_shared_experts") is not None else int(width > 0)
    return count, 0 < width == cfg.int("moe_intermediate_size")


def block_fusion(i: Inputs, row: BlockFusion) -> tuple[bool, str, str]:
    """Qwen2MoeSparseMoeBlock.__init__'s fusion, built by `row.builder`: supported on CUDA where the builder enables
    it, then num_shared_experts > 0 and can_fuse_shared_expert, then off on a per-rank fused-slot backend under EP."""
    where = f"SGLang's Qwen2-MoE block as {row.builder} builds it"
    aiter = i.use_aiter and i.device.kind == "hip"
    if not (aiter or row.on_cuda and i.device.kind == "cuda"):
        return False, "sglang.block.qwen2_moe.device", (
            f"{where} fuses only " + ("on CUDA or " if row.on_cuda else "")
            + f"on ROCm with aiter (SGLANG_USE_AITER=1), not on {i.device}"
            + (" without SGLANG_USE_AITER" if i.device.kind == "hip" else ""))
    if i.block_shared == 0:
        return False, "sglang.block.qwen2_moe.no_shared_experts", f"{where}: no shared experts (num_shared_experts 0)"
    if not i.block_widths_fit:
        return False, "sglang.block.qwen2_moe.intermediate_size", (
            f"{where}: shared_expert_intermediate_size is not moe_intermediate_size (can_fuse_shared_expert)")
    if i.a2a in ("deepep", "deepep_v2", "mori"):
        return False, "sglang.block.qwen2_moe.a2a", f"{where}: no fusion with --moe-a2a-backend {i.a2a}"
    if i.quant_blocks_fusion:
        return False, "sglang.block.qwen2_moe.quantization", (
            f"{where}: the quantization keeps the shared expert out of the routed path (can_fuse_shared_expert)")
    if i.a2a in PER_RANK_FUSED_SLOTS and i.shape.ep > 1:
        return False, "sglang.block.qwen2_moe.per_rank_slots", (
            f"{where}: its single global shared slot does not fit {i.a2a}'s per-rank shared slots at "
            f"moe_ep_size={i.shape.ep}")
    if i.block_shared > 1 and row.refuses_more_than_one:
        raise FailedPrecondition(f"config.n_shared_experts: SGLang {i.release.version} refuses to start: {row.builder} "
                                 f"fuses "
                                 f"exactly one shared expert, got n_shared_experts={i.block_shared}")
    return True, "sglang.block.qwen2_moe.fused", f"{where}: {i.block_shared} shared expert(s) fused as routed slot " \
                                                 f"{i.layout.n_routed}" + (" (ROCm aiter, SGLANG_USE_AITER=1)"
                                                                           if aiter else "")


def fusion(i: Inputs) -> tuple[bool, str, str]:
    """(fused, rule, reason) as resolve_shared_experts_config answers (or the block that decides itself)."""
    if i.disable_fusion:
        return False, "sglang.disable_shared_experts_fusion", "--disable-shared-experts-fusion (the gate is not asked)"
    if i.entry_class in i.release.unregistered:
        return False, "sglang.transformers_backend", (f"SGLang {i.release.version} registers no {i.entry_class}: "
                                                      f"transformers' own model fuses nothing")
    if i.entry_class in BLOCK_FUSION:
        return block_fusion(i, BLOCK_FUSION[i.entry_class])
    if not i.nested_gate_speaks:
        return False, "sglang.nested_gate_silent", (
            f"SGLang's {i.entry_class} fuses only when {NESTED_GATES[i.entry_class].when}: otherwise its gate "
            f"answers None and num_fusable_shared_experts 0")
    row = GATES.get(i.entry_class)
    if row is None:
        return False, "sglang.no_gate", (f"SGLang's {i.entry_class} has no shared_experts_fusion_disable_reason: "
                                         f"its shared experts are never fused")
    reason = row.gate(i, row.fused_architecture)
    if reason:
        return False, f"sglang.gate.{row.gate.__name__}", reason
    if i.layout.n_shared == 0:
        return False, "sglang.no_shared_experts", "no shared experts (num_fusable_shared_experts is 0)"
    return True, f"sglang.fused.{row.gate.__name__}", (
        f"{i.layout.n_shared} shared expert(s) fused as routed slot {i.layout.n_routed}"
        + (" (--enforce-shared-experts-fusion)" if i.enforce_fusion else ""))


# --- 4. forward path --------------------------------------------------------------------------------------------------

# Per MoE block, the a2a backends whose forward takes the dispatch/combine branch: the release's `dispatch_branch`.
# Every other backend runs the block's normal branch (partial sums, then the block's all-reduce), where the experts
# layer's own dispatcher (A2A_DISPATCHER) may still dispatch and combine.
# The block each entry class builds (models/registry.py; the oracle's FAMILY_BLOCKS). A class not here builds a
# block whose forward has no dispatch branch.
BLOCKS = {
    "DeepseekV2ForCausalLM": "deepseek", "DeepseekV3ForCausalLM": "deepseek", "DeepseekV32ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLMNextN": "deepseek", "GlmMoeDsaForCausalLM": "deepseek",
    "KimiK25ForConditionalGeneration": "deepseek", "KimiVLForConditionalGeneration": "deepseek",
    "DotsVLMForCausalLM": "deepseek", "DeepseekVL2ForCausalLM": "deepseek",
    "Glm4MoeForCausalLM": "glm4_moe", "Glm4MoeForCausalLMNextN": "glm4_moe",
    "Glm4vMoeForConditionalGeneration": "glm4_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_moe",
    # deepseek_v4.py builds deepseek_v2.DeepseekV2MoE; mistral_large_3.py / pixtral.py DeepSeek-V3's model;
    # deepseek_ocr.py DeepSeek-V2's
    "DeepseekV4ForCausalLM": "deepseek", "MistralLarge3ForCausalLM": "deepseek",
    "PixtralForConditionalGeneration": "deepseek", "DeepseekOCRForCausalLM": "deepseek",
    "MiniMaxM3SparseForCausalLM": "minimax_m3", "Dots3NoteForCausalLM": "dots3",
    # qwen3_next.py, qwen3_5.py (and minicpmv.py's Qwen3.5 text model) build the Qwen2-MoE block
    **dict.fromkeys(BLOCK_FUSION, "qwen2_moe"),
    "MiniMaxM2ForCausalLM": "minimax_m2", "ExaoneMoeForCausalLM": "exaone_moe", "MiMoV2FlashForCausalLM": "mimo_v2",
    # step3p7.py builds step3p5.py's text model
    "Step3p5ForCausalLM": "step3p5", "Step3p7ForConditionalGeneration": "step3p5",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite", "Glm4MoeLiteForCausalLMNextN": "glm4_moe_lite",
    "MellumForCausalLM": "qwen3_moe",      # mellum.py builds qwen3_moe.py's block
    "GptOssForCausalLM": "gpt_oss",        # its forward has no dispatch branch (NOT_IMPLEMENTED_BRANCH)
}
# layers/moe/fused_moe_triton/layer.py: create_moe_dispatcher: the backends whose experts layer dispatches and
# combines itself (MaybeTboDeepEPDispatcher, DeepEPv2Dispatcher, FlashinferDispatcher); none, megamoe,
# flashinfer_megamoe and ascend_fuseep get the StandardDispatcher.
A2A_DISPATCHER = frozenset({"deepep", "mooncake", "mori", "nixl", "pplx", "deepep_v2", "flashinfer"})
# layers/moe/utils.py: uses_per_rank_fused_shared_slots: every rank holds its own fused shared slot.
PER_RANK_FUSED_SLOTS = DEEPEP_CLASS | {"megamoe"}


def forward(i: Inputs) -> Forward:
    """The forward path and post-experts reduction of the block SGLang builds, as its code runs them."""
    block = BLOCKS.get(i.entry_class)
    if i.a2a in i.release.dispatch_branch.get(block, ()):
        return Forward("a2a", False, f"sglang.forward.{block}.dispatch",
                       f"SGLang's {block} MoE block takes its dispatch/combine branch for {i.a2a}: the combine "
                       f"returns each token's complete output")
    complete = i.a2a in COMPLETE_COMBINE
    inside = i.a2a in A2A_DISPATCHER or (complete and i.a2a != "none")
    split = (i.shape.ep > 1 or i.shape.moe_tp > 1) and not complete
    where = f"SGLang's {block or i.entry_class} normal branch"
    if inside:
        return Forward("a2a", split, f"sglang.forward.{i.a2a}.inside_experts",
                       f"{where}: the experts layer's {i.a2a} dispatcher dispatches and combines"
                       + ("; the block then all-reduces" if split else
                          " and its combine sums each token's outputs back to its rank: no all-reduce"))
    return Forward("normal", split, "sglang.forward.normal",
                   f"{where} with experts split over SGLang's ep_size={i.shape.ep}, moe_tp_size={i.shape.moe_tp}: "
                   f"each rank holds partial sums, then the all-reduce" if split
                   else f"{where}, experts not split: nothing to reduce")


# --- 5. pipeline and EPLB ---------------------------------------------------------------------------------------------

def stage_range(n_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """distributed/utils.py: get_pp_indices: every stage num_layers // pp_size layers, the LAST
    num_layers % pp_size stages one more. SGLANG_PP_LAYER_PARTITION, an environment override, is not an input: the
    SGLang adapter stops a runner whose stage it moves (loadplan/integrations/sglang.py, `_stage_refusal`)."""
    if pp_size > n_layers:
        raise FailedPrecondition(f"parallel.pp_size: {pp_size} stages for {n_layers} layers leaves a stage empty")
    base, extra = divmod(n_layers, pp_size)
    sizes = [base + (1 if r >= pp_size - extra else 0) for r in range(pp_size)]
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def check_backend(name: str, release: Release) -> str:
    if name not in release.a2a_backends:
        raise NotFound(f"a2a backend of SGLang {release.version}", name, release.a2a_backends,
                       field="runtime.a2a_backend")
    return name


def check_runner(name: str, release: Release) -> str:
    name = name or "auto"
    if name not in release.moe_runner_backends:
        raise NotFound(f"moe runner backend of SGLang {release.version}", name, release.moe_runner_backends,
                       field="runtime.moe_runner_backend")
    return name


# --- the profile's one entry point -------------------------------------------------------------------------------------

def quant_facts(qconfig: dict | None, q: Quantization) -> tuple[str | None, bool, bool]:
    """(SM100 runner key, W4AFP8/W4A16, quantization blocks fusion) of a checkpoint's quantization as SGLang reads
    it: `is_wint4afp8_or_wint4a16_config`, `quant_blocks_shared_experts_fusion` (Quark's can_fuse_shared_expert())
    and the Kimi int4 recipe of overrides.py."""
    qconfig = qconfig if isinstance(qconfig, dict) else {}
    name = q.name
    key = name
    w4a16 = name in ("w4afp8", "wint4afp8", "wint4a16")
    if name == "compressed_tensors":
        groups = qconfig.get("config_groups") or {}
        g0 = groups.get("group_0") or {}
        w = g0.get("weights") or {}
        if (w.get("num_bits"), w.get("group_size"), w.get("strategy"), w.get("type")) == (4, 32, "group", "int"):
            key = "kimi_int4"
        for group in groups.values():
            if not isinstance(group, dict) or "Linear" not in (group.get("targets") or []):
                continue
            gw, ga = group.get("weights") or {}, group.get("input_activations")
            if gw.get("num_bits") == 4 and gw.get("type") == "int" and (
                    ga is None or (ga.get("num_bits") == 8 and ga.get("type") == "float")):
                w4a16 = True
    blocks = name == "quark" and q.excludes("shared_expert")
    return key, w4a16, blocks


def fp4_experts(entry_class: str, qconfig: dict | None) -> bool:
    """configs/model_config.py: ModelConfig.is_fp4_experts: a mixed checkpoint's routed_experts_quant_method mxfp4, and
    for DeepSeek-V4 without one, SGLANG_DSV4_FP4_EXPERTS (default true; SGLang reads the weights' headers first,
    which a plan's inputs do not hold)."""
    method = (qconfig if isinstance(qconfig, dict) else {}).get("routed_experts_quant_method")
    return method == "mxfp4" or (method is None and entry_class == "DeepseekV4ForCausalLM")


@dataclass(frozen=True)
class Decided:
    inputs: Inputs
    rewrites: tuple[Rewrite, ...]
    fused: tuple[bool, str, str]
    forward: Forward


def decide(*, entry_class: str, architecture: str, layout: MoeLayout, quantization: Quantization,
           qconfig: dict | None, device: Device, a2a: str, runner: str, tp: int, ep: int, dp: int, sbo: bool,
           tbo: bool, disable_fusion: bool, enforce_fusion: bool, draft: bool, config: Any = None,
           cfg: Any = None, release: Release | None = None, use_aiter: bool = False) -> Decided:
    """SGLang's decisions for one deployment, or FAILED_PRECONDITION (a start-up refusal, or a hazard). `config`: the
    checkpoint's config.json; `cfg`: the ConfigView of the config the family reads (for a block that fuses itself)."""
    from . import hazards

    from .sglang_releases import NEWEST

    release = release or NEWEST
    check_backend(a2a, release)
    runner = check_runner(runner, release)
    checkpoint_quantization = quantization.name
    if entry_class in MINIMAX_M3_ARCHS and "minimax_m3_nvfp4" in release.overrides:
        quantization = minimax_m3_quantization(quantization, qconfig)
    key, w4a16, blocks = quant_facts(qconfig, quantization)
    # Server-args resolution copies the checkpoint's quant_method into --quantization only in the SM100 overrides
    # of the families that have one (overrides.py, model_overrides/*): elsewhere it stays unset (None).
    server_q = None
    row = sm100_runner(entry_class)
    if (is_sm100(device) and row is not None and row.copies_quantization or entry_class in MINIMAX_M3_ARCHS) \
            and quantization.name:
        server_q = sglang_name(quantization.name)
    a2a, runner, shape, disable, kernel_hook_a2a, rewrites = rewrite(entry_class, key, a2a, runner,
                                                                     Shape(tp * ep, ep, dp), device, disable_fusion,
                                                                     release, server_q,
                                                                     fp4_experts(entry_class, qconfig))
    shared, fit = block_shared(cfg) if entry_class in BLOCK_FUSION else (0, False)
    raw = config if isinstance(config, Mapping) else {}
    archs = raw.get("architectures")
    layer_types = tuple((f, raw.get(f) if isinstance(raw.get(f), list) else None) for f in ("layer_types",
                                                                                          "mlp_layer_types"))
    i = Inputs(entry_class, architecture, layout, quantization, device, a2a, runner, shape, sbo, tbo, disable,
               enforce_fusion, draft, blocks, w4a16, server_q, nested_gate_speaks(entry_class, config), shared, fit,
               ep, kernel_hook_a2a, tuple(a for a in archs if isinstance(a, str)) if isinstance(archs, list) else (),
               checkpoint_quantization, release, str(raw.get("model_type") or ""),
               layer_types if "num_hidden_layers" in raw else (), use_aiter)
    refuse(i)
    fused = fusion(i)
    block = BLOCKS.get(entry_class)
    missing = NOT_IMPLEMENTED_BRANCH.get(block, {}).get(a2a)
    if missing:   # the block's forward raises at the first batch
        raise FailedPrecondition(f"runtime.a2a_backend: SGLang {release.version} cannot run {entry_class}'s MoE block with "
                                 f"--moe-a2a-backend {a2a}: NotImplementedError: {missing}")
    if entry_class in release.unregistered:
        return Decided(i, tuple(rewrites), fused, Forward(
            "normal", False, "sglang.forward.transformers_backend",
            f"SGLang {release.version} registers no {entry_class}: it runs transformers' own model "
            f"(TransformersMoEForCausalLM), whose forward path the profile does not restate"))
    fwd = forward(i)
    # Hazards last: SGLang starts and runs these layouts (a start-up refusal above is SGLang's answer instead).
    lay = layout
    if fwd.path == "a2a" and fwd.all_reduce:
        raise hazards.refuse("sglang.double_reduction",
                             f"{entry_class} with --moe-a2a-backend {a2a} at ep_size={shape.ep}")
    if fused[0] and fwd.path == "a2a" and a2a not in PER_RANK_FUSED_SLOTS:
        raise hazards.refuse("sglang.fused_global_slot_on_dispatch",
                             f"{entry_class} with its shared expert fused and --moe-a2a-backend {a2a}")
    if (fused[0] and enforce_fusion and GATES.get(entry_class, GateRow(glm45_gate, "")).gate is deepseek_gate
            and lay.n_routed == 384 and quantization.name != "quark"):
        raise hazards.refuse("sglang.enforced_384_without_quark",
                             f"{entry_class} with 384 routed experts, quantization {quantization.name or 'none'}")
    return Decided(i, tuple(rewrites), fused, fwd)


# Per MoE block, the a2a backends whose branch its forward does not implement, and what it raises.
NOT_IMPLEMENTED_BRANCH = {
    "gpt_oss": {"deepep": "forward_deepep branch not implemented yet"},   # models/gpt_oss.py: GptOssSparseMoeBlock
}


def check_draft(family: str, cfg, release: Release) -> None:
    """A NextN draft loads exactly one MTP layer: its weight loader asserts num_nextn_predict_layers == 1 before it
    reads a tensor (models/deepseek_common/deepseek_weight_loader.py: _initialize_nextn_conf; glm4_moe.py and
    glm4_moe_lite.py: load_weights), so a checkpoint that ships none (Kimi-K2's 0) or several is refused with
    SGLang's words. Asked before the start-up checks of `decide`: a draft without an MTP layer has no layout to check
    them on."""
    if not family.endswith("_nextn"):
        return
    count = cfg.raw("num_nextn_predict_layers")
    if count is not None and count != 1:
        field = cfg.field("num_nextn_predict_layers")
        raise FailedPrecondition(f"{field}: SGLang {release.version} refuses to load the draft: "
                                 f"{release.say('nextn.layers')} (num_nextn_predict_layers is {count})", field=field)


def _from_first_k(cfg, n_layers: int) -> tuple[int, ...]:
    """Every layer from first_k_dense_replace (getattr's default: 0) on, as moe_layer_freq (1) keeps them."""
    first, freq = cfg.int("first_k_dense_replace", 0, minimum=0), cfg.int("moe_layer_freq", 1, minimum=1)
    return tuple(i for i in range(first, n_layers) if i % freq == 0)


def _flags(name: str) -> Callable[[Any, int], tuple[int, ...] | None]:
    """The layers a per-layer list of flags marks (None without it: SGLang reads no other field)."""
    return lambda cfg, n: None if cfg.raw(name) is None else layer_flags(cfg, name, n)


def _every_layer(cfg, n_layers: int) -> tuple[int, ...]:
    return tuple(range(n_layers))


def _ernie(cfg, n_layers: int) -> tuple[int, ...]:
    """moe_layer_interval counted from moe_layer_start_index (transformers counts it from layer 0)."""
    start, end, interval = ernie_moe_span(cfg, n_layers)
    return tuple(i for i in range(n_layers) if start <= i <= end and (i - start) % interval == 0)


@dataclass(frozen=True)
class Placement:
    """How SGLang places a family's MoE layers: `place(cfg, n_layers)` (None: it cannot load the config), by the
    field `reads` (None: by no field of the config); a refusal names `reads` where the config leaves it out, else the
    first of `fields` (the fields the two readings differ on) that the config gives a telling value."""
    reads: str | None
    fields: tuple[str, ...]
    place: Callable[[Any, int], tuple[int, ...] | None]


def _step3p5(cfg, n_layers: int) -> tuple[int, ...] | None:
    """configs/step3p5.py splits moe_layers_enum, a string, and reads no mlp_layer_types."""
    enum = cfg.raw("moe_layers_enum")
    return None if not isinstance(enum, str) else tuple(sorted(layer_numbers(cfg, "moe_layers_enum", enum)
                                                               & set(range(n_layers))))


# Where SGLang places a family's MoE layers otherwise than transformers, whose reading is the layout's
# (models/<module>.py of SGLang 0.5.23, as noted).
_QWEN = Placement(None, ("decoder_sparse_step", "mlp_only_layers"), _every_layer)   # qwen2_moe.py, qwen3_*.py
_FIRST_K = Placement("first_k_dense_replace", ("first_k_dense_replace", "mlp_layer_types"), _from_first_k)
SGLANG_MOE_LAYERS: dict[str, Placement] = {
    "qwen2_moe": _QWEN, "qwen3_moe": _QWEN, "qwen3_next": _QWEN,
    "kimi_linear": Placement("first_k_dense_replace", ("moe_layer_freq", "first_k_dense_replace", "mlp_layer_types"),
                             _from_first_k),                                       # kimi_linear.py
    "hy_v3": _FIRST_K,                                                             # hunyuan_v3.py
    "cohere2_moe": _FIRST_K,                                                       # cohere2_moe.py
    # glm4_moe_lite.py: moe_layer_freq forced to 1; without first_k_dense_replace, an AttributeError
    "glm4_moe_lite": Placement("first_k_dense_replace", ("first_k_dense_replace", "mlp_layer_types"),
                               lambda cfg, n: _from_first_k(cfg, n) if cfg.has("first_k_dense_replace") else None),
    "mimo_v2_flash": Placement("moe_layer_freq", ("moe_layer_freq",), _flags("moe_layer_freq")),   # mimo_v2.py
    "exaone_moe": Placement("is_moe_layer", ("is_moe_layer",), _flags("is_moe_layer")),           # exaone_moe.py
    "ernie4_5_moe": Placement(None, ("moe_layer_interval",), _ernie),                              # ernie4.py
    # llama4.py: by interleave_moe_layer_step alone (transformers reads moe_layers where a config gives it)
    "llama4": Placement(None, ("moe_layers",), interleaved_moe_layers),
    "step3p5": Placement("moe_layers_enum", ("moe_layers_enum", "mlp_layer_types"), _step3p5),
}


def check_layout(family: str, cfg, layout: MoeLayout) -> None:
    """Refuses a config SGLang would build otherwise than `layout`, its plan: other MoE layers
    (`SGLANG_MOE_LAYERS`), other routed-expert counts or top-k (`SGLANG_EXPERT_COUNTS`)."""
    _check_placement(family, cfg, layout)
    _check_expert_counts(family, cfg, layout)


def _check_placement(family: str, cfg, layout: MoeLayout) -> None:
    placement = SGLANG_MOE_LAYERS.get(family)
    if placement is None:
        return
    moe = placement.place(cfg, len(layout.layer_ids))
    if moe is None or moe != layout.moe_layers:
        if placement.reads is not None and not cfg.has(placement.reads):
            field = placement.reads
        else:
            field = next((f for f in placement.fields if cfg.has(f) and cfg.raw(f) not in (1, [])), placement.fields[0])
        if moe is None:
            raise InvalidArgument(cfg.field(field), f"missing: SGLang places {family}'s MoE layers by it")
        raise InvalidArgument(cfg.field(field), f"SGLang places {family}'s MoE layers at {list(moe)[:8]}, this "
                                                f"config's fields as transformers reads them at "
                                                f"{list(layout.moe_layers)[:8]}")


# Where SGLang counts a family's experts otherwise than transformers: the routed experts and top-k SGLang builds
# (None: as the layout says), and the fields it reads them by, named in the refusal.
SGLANG_EXPERT_COUNTS: dict[str, tuple[tuple[str, str], Callable[[Any], tuple[int | None, int | None]]]] = {
    # configs/step3p5.py: Step3p5Config reads moe_num_experts and moe_top_k alone (transformers' names: n_routed_experts,
    # num_experts_per_tok)
    "step3p5": (("moe_num_experts", "moe_top_k"),
                lambda cfg: (cfg.int("moe_num_experts", 288, minimum=1), cfg.int("moe_top_k", 8, minimum=1))),
    # models/phimoe.py: its router asserts top-2 at the first forward
    "phimoe": (("num_local_experts", "num_experts_per_tok"), lambda cfg: (None, 2)),
}


def _check_expert_counts(family: str, cfg, layout: MoeLayout) -> None:
    if family not in SGLANG_EXPERT_COUNTS:
        return
    (experts_field, top_k_field), counts = SGLANG_EXPERT_COUNTS[family]
    n_routed, top_k = counts(cfg)
    if n_routed is not None and n_routed != layout.n_routed:
        raise InvalidArgument(cfg.field(experts_field), f"SGLang builds {n_routed} routed experts by it, this "
                                                        f"config's fields as transformers reads them {layout.n_routed}")
    if top_k is not None and top_k != layout.top_k:
        raise InvalidArgument(cfg.field(top_k_field), f"SGLang routes each token to {top_k} experts by it, this "
                                                      f"config's fields as transformers reads them to {layout.top_k}")
