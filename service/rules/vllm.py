"""The vLLM 0.32.0 profile (DESIGN 8.2): data restating vLLM's fused-MoE layer (paths under `vllm/` of the wheel).

- Backend names: `config/parallel.py: All2AllBackend` (`--all2all-backend`, default `allgather_reducescatter`).
- Whether the all-to-all kernels run at all: `model_executor/layers/fused_moe/config.py:
  FusedMoEParallelConfig.use_all2all_kernels` = expert parallelism and DP > 1 (PCP and sequence parallelism are
  not plan inputs). Without them the layer is the NoDPEP prepare/finalize: partial sums, then the reduction.
- Reduction: `output_is_reduced()` of the backend's prepare/finalize (`prepare_finalize/*.py`), read by
  MoERunner to skip its all-reduce.
- Shared experts: DeepSeek's layer fuses only when `resolve_layer_fused_shared_expert()` says so, i.e. on ROCm
  with AITER (`VLLM_ROCM_USE_AITER`, `VLLM_ROCM_USE_AITER_MOE`, `VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS`).
  Those are environment flags, not plan inputs; vLLM's defaults leave VLLM_ROCM_USE_AITER off, so the profile
  answers for the default environment: unfused everywhere.
- Pipeline stages: `distributed/utils.py: get_pp_indices`, the same partition as SGLang's (the last stages take
  the leftover layers).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NotFound

NAME = "vllm"
VERSION = "0.32.0"


@dataclass(frozen=True)
class All2AllRow:
    name: str
    output_is_reduced: bool      # the prepare/finalize's combine already summed the experts' outputs
    source: str                  # the prepare/finalize class it builds


ALL2ALL: dict[str, All2AllRow] = {
    r.name: r
    for r in (
        All2AllRow("naive", False, "prepare_finalize/naive_dp_ep.py: MoEPrepareAndFinalizeNaiveDPEP*"),
        All2AllRow("allgather_reducescatter", False, "prepare_finalize/naive_dp_ep.py (all-gather / reduce-scatter)"),
        All2AllRow("deepep_high_throughput", True, "prepare_finalize/deepep_ht.py"),
        All2AllRow("deepep_low_latency", True, "prepare_finalize/deepep_ll.py"),
        All2AllRow("deepep_v2", True, "prepare_finalize/deepep_v2.py"),
        All2AllRow("mori_high_throughput", True, "prepare_finalize/mori.py"),
        All2AllRow("mori_low_latency", True, "prepare_finalize/mori.py"),
        All2AllRow("moonep", True, "prepare_finalize/moonep.py"),
        All2AllRow("nixl_ep", True, "prepare_finalize/nixl_ep.py"),
        All2AllRow("flashinfer_all2allv", True, "prepare_finalize/flashinfer_nvlink_two_sided.py (an alias)"),
        All2AllRow("flashinfer_nvlink_two_sided", True, "prepare_finalize/flashinfer_nvlink_two_sided.py"),
        All2AllRow("flashinfer_nvlink_one_sided", True, "prepare_finalize/flashinfer_nvlink_one_sided.py"),
        All2AllRow("passthrough", True, "prepare_finalize/passthrough.py (the MoE kernel dispatches itself)"),
    )
}
DEFAULT_ALL2ALL = "allgather_reducescatter"
# The prepare/finalize without all-to-all kernels (EP off, or DP == 1).
NO_DP_EP = All2AllRow("no_dp_ep", False, "prepare_finalize/no_dp_ep.py: MoEPrepareAndFinalizeNoDPEP*")


def all2all(name: str) -> All2AllRow:
    """The row of `name` ("" or "none": vLLM's default); NOT_FOUND listing the known names otherwise. (vLLM's
    Literal also names pplx, which has no prepare/finalize in 0.32.0: not accepted here.)"""
    name = DEFAULT_ALL2ALL if name in ("", "none") else name
    try:
        return ALL2ALL[name]
    except KeyError:
        raise NotFound("vllm all2all backend", name, ALL2ALL, field="runtime.a2a_backend") from None


@dataclass(frozen=True)
class Forward:
    path: str
    all_reduce: bool
    rule: str
    reason: str


def forward(a2a: str, tp: int, ep: int, dp: int) -> Forward:
    """FusedMoEParallelConfig.make's use_all2all_kernels, then the prepare/finalize's output_is_reduced()."""
    row = all2all(a2a)
    use_ep = ep > 1
    if not (use_ep and dp > 1):
        split = tp * ep > 1
        return Forward("normal", split, "vllm.no_all2all_kernels",
                       f"all2all kernels run only with expert parallelism and DP > 1 (use_all2all_kernels; "
                       f"ep_size={ep}, dp_size={dp}): {NO_DP_EP.source}, partial sums"
                       + (", then the all-reduce" if split else ", nothing split to reduce"))
    if row.output_is_reduced:
        return Forward("a2a", False, f"vllm.all2all.{row.name}",
                       f"{row.source}: dispatch and combine; output_is_reduced() is true, MoERunner skips its "
                       f"reduction")
    return Forward("normal", True, f"vllm.all2all.{row.name}",
                   f"{row.source}: tokens gathered, each rank's partial sums reduce-scattered (output_is_reduced() "
                   f"is false)")


FUSION_RULE = "vllm.fusion.rocm_aiter_only"
FUSION_REASON = ("vLLM fuses a shared expert only on ROCm with AITER (resolve_layer_fused_shared_expert: "
                 "VLLM_ROCM_USE_AITER, VLLM_ROCM_USE_AITER_MOE, VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS), "
                 "which vLLM's defaults leave off: unfused")
