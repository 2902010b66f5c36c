"""The MoE blocks SGLang 0.5.23 builds that dispatch and combine themselves for some a2a backends (DESIGN 8.1): on
those the block's own dispatch branch runs, with no reduction after it, so the profile plans the a2a path, not a
double reduction. tests/conformance checks every backend and shape against SGLang's code (its `blocks` sub-grid);
these pin one case per block, on the same minimal configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadplan.plan import Keys
from loadplan.errors import FailedPrecondition

from ._fixtures import resolve

CONFIGS = Path(__file__).resolve().parents[2] / "conformance" / "configs"


def config(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def sglang(name: str, **kw):
    kw.setdefault("device", "cuda:9.0")
    return resolve(config(name), engine="sglang", **kw).decisions


@pytest.mark.parametrize("name, backend, block", [
    ("tiny-minimax-m2", "deepep", "minimax_m2"), ("tiny-minimax-m2", "ascend_fuseep", "minimax_m2"),
    ("tiny-exaone-moe", "deepep", "exaone_moe"),
    ("tiny-mimo-v2-flash", "deepep", "mimo_v2"), ("tiny-mimo-v2-flash", "mooncake", "mimo_v2"),
    ("tiny-step3p5", "deepep", "step3p5"),
    ("tiny-glm-4.7-flash", "deepep", "glm4_moe_lite"), ("tiny-glm-4.7-flash", "mooncake", "glm4_moe_lite"),
    ("tiny-minimax-m3", "megamoe", "minimax_m3"),
])
def test_a_block_that_dispatches_itself_is_planned_on_its_dispatch_branch(name, backend, block):
    d = sglang(name, tp_size=2, ep_size=4, a2a_backend=backend)
    assert (d[Keys.FORWARD_PATH].value, d[Keys.POST_EXPERTS_ALL_REDUCE].value) == ("a2a", False)
    assert d[Keys.FORWARD_PATH].rule == f"sglang.forward.{block}.dispatch"


def test_a_backend_its_block_does_not_dispatch_is_still_a_double_reduction():
    # MiniMax-M2's block runs its normal branch under mooncake: the experts layer's dispatcher combines, then the
    # block all-reduces what the combine summed
    with pytest.raises(FailedPrecondition, match=r"^hazard: sglang\.double_reduction: MiniMaxM2ForCausalLM"):
        sglang("tiny-minimax-m2", tp_size=2, ep_size=4, a2a_backend="mooncake")


def test_deepep_v2_runs_the_architectures_sglang_validated_for_it_and_refuses_the_others():
    d = sglang("tiny-mimo-v2-flash", tp_size=2, ep_size=4, a2a_backend="deepep_v2")
    assert d[Keys.FORWARD_PATH].value == "a2a"
    v32 = dict(config("tiny-deepseek-v3-unshared"), architectures=["DeepseekV32ForCausalLM"])
    with pytest.raises(FailedPrecondition, match=r"DeepEP v2 MoE is not validated for 'DeepseekV32ForCausalLM'"):
        resolve(v32, engine="sglang", device="cuda:9.0", tp_size=2, ep_size=4, a2a_backend="deepep_v2")


def test_an_unquantized_minimax_m3_runs_the_triton_runner_which_pplx_refuses():
    d = sglang("tiny-minimax-m3", tp_size=8)
    assert d["sglang.moe_runner_backend"].value == "triton" and "bf16 full weights" in \
        d["sglang.moe_runner_backend"].reason
    with pytest.raises(FailedPrecondition, match=r"^runtime\.moe_runner_backend: .*pplx.*deep_gemm"):
        sglang("tiny-minimax-m3", tp_size=1, ep_size=8, dp_size=8, a2a_backend="pplx")


def test_nemotron_h_runs_sglangs_flashinfer_cutlass_default_which_refuses_a_partial_ep_group():
    d = sglang("tiny-nemotron-h", tp_size=8)
    assert d["sglang.moe_runner_backend"].value == "flashinfer_cutlass"
    assert sglang("tiny-nemotron-h", tp_size=8, device="cuda:10.0")["sglang.moe_runner_backend"].value == \
        "flashinfer_trtllm"
    # its runner asserts ep in {1, tp} before an EP-spanning backend would widen ep to the tp group
    for backend in ("none", "megamoe"):
        with pytest.raises(FailedPrecondition, match=r"^runtime\.moe_runner_backend: .*: The "
                                                     r"expert parallel size must be 1 or the same as the tensor"):
            sglang("tiny-nemotron-h", tp_size=2, ep_size=4, a2a_backend=backend)


def test_an_asked_flashinfer_cutlass_runner_refuses_a_quantization_it_has_no_kernel_for():
    dsv3 = dict(config("tiny-deepseek-v3-unshared"))
    with pytest.raises(FailedPrecondition, match=r"Invalid quantization 'fp8'\. \nFlashInfer Cutlass MOE"):
        resolve(dsv3, engine="sglang", device="cuda:10.0", tp_size=8, moe_runner_backend="flashinfer_cutlass",
                quantization_config=dsv3.get("quantization_config"))


def test_mellum_builds_qwen3_moes_block_and_dispatches_where_it_does():
    d = sglang("tiny-mellum", tp_size=2, ep_size=4, a2a_backend="deepep")
    assert d[Keys.FORWARD_PATH].rule == "sglang.forward.qwen3_moe.dispatch"


def test_an_unquantized_cohere2_moe_on_sm100_runs_trtllm_which_pplx_refuses():
    d = sglang("tiny-cohere2moe", tp_size=8, device="cuda:10.0")
    assert d["sglang.moe_runner_backend"].value == "flashinfer_trtllm"
    assert sglang("tiny-cohere2moe", tp_size=8)["sglang.moe_runner_backend"].rule == "sglang.moe_runner_backend"
    with pytest.raises(FailedPrecondition, match=r"pplx"):
        sglang("tiny-cohere2moe", tp_size=1, ep_size=8, dp_size=8, a2a_backend="pplx", device="cuda:10.0")


def test_minimax_m3_nvfp4_is_served_as_sglang_resolves_it():
    """An MXFP8 checkpoint with NVFP4-packed experts is SGLang's minimax_m3_nvfp4: marlin off Blackwell, megamoe and
    deep_gemm on it, never its shared expert fused, and not on ROCm or before SM90."""
    d = sglang("tiny-minimax-m3-nvfp4", tp_size=8)
    assert d["sglang.moe_runner_backend"].value == "marlin"
    assert d[Keys.SHARED_EXPERTS_FUSION].value is False and "mixed-precision" in d[Keys.SHARED_EXPERTS_FUSION].reason
    d = sglang("tiny-minimax-m3-nvfp4", tp_size=8, device="cuda:10.0")
    assert (d["sglang.moe_a2a_backend"].value, d["sglang.moe_runner_backend"].value) == ("megamoe", "deep_gemm")
    assert (d[Keys.FORWARD_PATH].value, d[Keys.POST_EXPERTS_ALL_REDUCE].value) == ("a2a", False)
    with pytest.raises(FailedPrecondition, match=r"M3\.1 NVFP4 requires --moe-a2a-backend megamoe"):
        sglang("tiny-minimax-m3-nvfp4", tp_size=2, ep_size=4, a2a_backend="deepep", device="cuda:10.0")
    with pytest.raises(FailedPrecondition, match=r"minimax_m3_nvfp4 quantization is currently not supported in ROCm"):
        sglang("tiny-minimax-m3-nvfp4", tp_size=8, device="hip:9.4")
    with pytest.raises(FailedPrecondition, match=r"Minimum capability: 90\. Current capability: 80"):
        sglang("tiny-minimax-m3-nvfp4", tp_size=8, device="cuda:8.0")


def test_minimax_m3_mxfp8_needs_sm100_and_runs_deep_gemm_there():
    with pytest.raises(FailedPrecondition, match=r"The quantization method mxfp8 is not supported .* Minimum "
                                                 r"capability: 100"):
        sglang("tiny-minimax-m3-mxfp8", tp_size=8)
    assert sglang("tiny-minimax-m3-mxfp8", tp_size=8, device="cuda:10.0")["sglang.moe_runner_backend"].value == \
        "deep_gemm"


def test_a_modelopt_fp8_deepseek_is_modelopt_fp8_to_sglang():
    """ModelOpt's quant_method is modelopt, its format is quant_algo: SGLang serves FP8 as modelopt_fp8, which SM100's
    DeepSeek override runs on flashinfer_trtllm (so not fused), which needs SM89 and is not run on ROCm."""
    d = sglang("tiny-deepseek-v3-modelopt-fp8", tp_size=8, device="cuda:10.0")
    assert d["sglang.moe_runner_backend"].value == "flashinfer_trtllm"
    assert d[Keys.SHARED_EXPERTS_FUSION].value is False
    with pytest.raises(FailedPrecondition, match=r"modelopt_fp8 is not supported for the current GPU\. Minimum "
                                                 r"capability: 89"):
        sglang("tiny-deepseek-v3-modelopt-fp8", tp_size=8, device="cuda:8.0")
    with pytest.raises(FailedPrecondition, match=r"modelopt_fp8 quantization is currently not supported in ROCm"):
        sglang("tiny-deepseek-v3-modelopt-fp8", tp_size=8, device="hip:9.4")


def test_sm100s_trtllm_runner_for_the_deepseek_family_skips_longcat_flash_and_takes_quantized_mimo_and_minimax_m2():
    longcat = sglang("tiny-longcatflash", tp_size=8, device="cuda:10.0")["sglang.moe_runner_backend"]
    assert (longcat.value, longcat.rule) == ("auto", "sglang.moe_runner_backend")     # not rewritten
    assert sglang("tiny-mimo-v2-flash-fp8", tp_size=8, device="cuda:10.0")["sglang.moe_runner_backend"].value == \
        "flashinfer_trtllm"
    assert sglang("tiny-minimax-m2-modelopt-fp4", tp_size=8,
                  device="cuda:10.0")["sglang.moe_runner_backend"].value == "flashinfer_trtllm_routed"


def test_a_nextn_draft_on_sm100_runs_its_targets_trtllm_runner_so_it_is_not_fused():
    """SGLang picks one MoE runner per server, from the target's architecture: the NextN draft of a DeepSeek target
    on SM100 runs flashinfer_trtllm too, which turns its fusion off (a NextN draft request names its own class)."""
    cfg = dict(config("tiny-deepseek-v3-unshared"), n_shared_experts=1, n_routed_experts=256,
               num_nextn_predict_layers=1, architectures=["DeepseekV3ForCausalLMNextN"])
    cfg.pop("quantization_config")
    d = resolve(cfg, engine="sglang", device="cuda:10.0", tp_size=8, role="speculative").decisions
    assert d["sglang.moe_runner_backend"].value == "flashinfer_trtllm"
    assert d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert resolve(cfg, engine="sglang", device="cuda:9.0", tp_size=8,
                   role="speculative").decisions[Keys.SHARED_EXPERTS_FUSION].value is True
