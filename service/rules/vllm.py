"""The vLLM 0.31.0 and 0.32.0 profile (DESIGN 8.2): data restating vLLM's fused-MoE layer (paths under `vllm/` of the
wheel); what 0.32.0 changed is `RELEASES` (its `passthrough` backend).

- Backend names: `config/parallel.py: All2AllBackend` (`--all2all-backend`, default `allgather_reducescatter`).
- Whether the all-to-all kernels run at all: `model_executor/layers/fused_moe/config.py:
  FusedMoEParallelConfig.use_all2all_kernels` = expert parallelism and DP > 1 (PCP and sequence parallelism are
  not plan inputs), or `use_passthrough_all2all` (backend `passthrough`, in every topology). Without them the
  layer is the NoDPEP prepare/finalize (or the naive DP one with DP > 1): partial sums, then the reduction.
- Reduction: `fused_moe/runner/moe_runner.py: MoERunner._maybe_reduce_final_output` all-reduces iff the MoE is
  split (MoE tp_size or ep_size > 1) and `output_is_reduced()` of the prepare/finalize (`prepare_finalize/*.py`)
  is false.
- Shared experts: DeepSeek's layer fuses only when `resolve_layer_fused_shared_expert()` says so, i.e. on ROCm
  with AITER (`VLLM_ROCM_USE_AITER`, `VLLM_ROCM_USE_AITER_MOE`, `VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS`).
  Those are environment flags, not plan inputs; vLLM's defaults leave VLLM_ROCM_USE_AITER off, so the profile
  answers for the default environment: unfused everywhere.
- Pipeline stages: `distributed/utils.py: get_pp_indices`: the leftover layers go to the stages just BEFORE the
  last one (the last holds the final norm), unlike SGLang's split (stage_range below).
- The experts' parallel layout: `fused_moe/config.py: FusedMoEParallelConfig.make`: without expert parallelism
  the experts' tensor parallelism is flattened across DP (`flatten_tp_across_dp_and_pcp`: MoE tp_size = dp x tp),
  with it the MoE tp_size is 1 and ep_size = dp x tp (the plan's ep_size).
"""

from __future__ import annotations

from dataclasses import dataclass

from loadplan.errors import FailedPrecondition, NotFound
from .backends import Forward

NAME = "vllm"


@dataclass(frozen=True)
class All2AllRow:
    name: str
    output_is_reduced: bool      # the prepare/finalize's combine already summed the experts' outputs
    source: str                  # the prepare/finalize class it builds
    # FusedMoEParallelConfig.use_passthrough_all2all is "not gated on use_all2all_kernels" (config.py): the
    # experts dispatch and combine themselves in every topology, TP-only and unsplit included.
    always_dispatches: bool = False


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
        All2AllRow("passthrough", True, "prepare_finalize/passthrough.py (the MoE kernel dispatches itself)",
                   always_dispatches=True),
    )
}
DEFAULT_ALL2ALL = "allgather_reducescatter"
# The releases the profile answers for, each its predecessor plus what it changed, as the all2all backends it
# accepts (config/parallel.py: All2AllBackend, with a prepare/finalize; the rest of these tables held for both).
RELEASES: dict[str, frozenset[str]] = {"0.31.0": frozenset(ALL2ALL) - {"passthrough"}}
RELEASES["0.32.0"] = RELEASES["0.31.0"] | {"passthrough"}     # the MoE-EP megakernels' own dispatch
NEWEST = "0.32.0"
# The prepare/finalizes without all-to-all kernels (fused_moe/all2all_utils.py: maybe_make_prepare_finalize, the
# `not use_all2all_kernels` branch): with DP > 1 the naive DP one (tokens all-gathered across DP, outputs
# reduce-scattered back), else NoDPEP. Neither reduces over the experts' split: MoERunner all-reduces.
NO_DP_EP = All2AllRow("no_dp_ep", False, "prepare_finalize/no_dp_ep.py: MoEPrepareAndFinalizeNoDPEP*")
NO_ALL2ALL_DP = All2AllRow("no_all2all_dp", False,
                           "prepare_finalize/naive_dp_ep.py: MoEPrepareAndFinalizeNaiveDPEP* (no all2all kernels)")


def all2all(name: str, release: str = NEWEST) -> All2AllRow:
    """The row of `name` ("" or "none": vLLM's default) in `release`; NOT_FOUND listing that release's names
    otherwise. (vLLM's Literal also names pplx, which has no prepare/finalize in 0.31.0 or 0.32.0: not accepted.)"""
    name = DEFAULT_ALL2ALL if name in ("", "none") else name
    known = [n for n in ALL2ALL if n in RELEASES[release]]
    if name not in known:
        raise NotFound(f"all2all backend of vllm {release}", name, known, field="runtime.a2a_backend")
    return ALL2ALL[name]


def moe_split(tp: int, ep: int, dp: int) -> tuple[int, int]:
    """(MoE tp_size, ep_size) as FusedMoEParallelConfig.make sets them: without expert parallelism the experts'
    tensor parallelism spans every DP x TP device (flatten_tp_across_dp_and_pcp); with it the experts are whole
    on each rank (MoE tp_size 1) and ep_size is the plan's."""
    return (tp * dp, 1) if ep == 1 else (1, ep)


def forward(a2a: str, tp: int, ep: int, dp: int, release: str = NEWEST) -> Forward:
    """The forward path (dispatch/combine kernels or not) and MoERunner's reduction after the experts.

    - Kernels run iff use_passthrough_all2all, or use_all2all_kernels = use_ep and DP > 1 (fused_moe/config.py).
    - MoERunner._maybe_reduce_final_output (fused_moe/runner/moe_runner.py) all-reduces iff (MoE tp_size > 1 or
      ep_size > 1) and not output_is_reduced() of the prepare/finalize (sequence parallelism is not a plan input).
    """
    row = all2all(a2a, release)
    moe_tp, moe_ep = moe_split(tp, ep, dp)
    split = moe_tp > 1 or moe_ep > 1
    sizes = f"MoE tp_size={moe_tp}, ep_size={moe_ep}"
    if row.always_dispatches:
        return Forward("a2a", split and not row.output_is_reduced, f"vllm.all2all.{row.name}",
                       f"{row.source}: use_passthrough_all2all is not gated on use_all2all_kernels; "
                       f"output_is_reduced() is true, MoERunner skips its reduction ({sizes})")
    if not (ep > 1 and dp > 1):
        pf = NO_ALL2ALL_DP if dp > 1 else NO_DP_EP
        return Forward("normal", split and not pf.output_is_reduced, "vllm.no_all2all_kernels",
                       f"all2all kernels run only with expert parallelism and DP > 1 (use_all2all_kernels; "
                       f"ep_size={ep}, dp_size={dp}): {pf.source}, "
                       + (f"partial sums over {sizes}, then MoERunner's all-reduce" if split
                          else "experts not split, nothing to reduce"))
    if row.output_is_reduced:
        return Forward("a2a", False, f"vllm.all2all.{row.name}",
                       f"{row.source}: dispatch and combine; output_is_reduced() is true, MoERunner skips its "
                       f"reduction")
    return Forward("a2a", True, f"vllm.all2all.{row.name}",
                   f"{row.source}: tokens dispatched (gathered) and combined (reduce-scattered); "
                   f"output_is_reduced() is false, MoERunner all-reduces over {sizes}")


def stage_range(n_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """distributed/utils.py: get_pp_indices: every stage n_layers // pp_size layers, then one more for each of the
    n_layers % pp_size stages just before the last (`partitions[-i] += 1 for i in range(2, remaining + 2)`: the last
    stage holds the final norm and the head). VLLM_PP_LAYER_PARTITION, an environment override, is not a plan
    input. A stage with no layers is refused, as the other profiles refuse it."""
    if pp_size > n_layers:
        raise FailedPrecondition(f"parallel.pp_size: {pp_size} stages for {n_layers} layers leaves a stage empty")
    base, extra = divmod(n_layers, pp_size)
    sizes = [base] * pp_size
    for i in range(2, extra + 2):
        sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


FUSION_RULE = "vllm.fusion.rocm_aiter_only"
FUSION_REASON = ("vLLM fuses a shared expert only on ROCm with AITER (resolve_layer_fused_shared_expert: "
                 "VLLM_ROCM_USE_AITER, VLLM_ROCM_USE_AITER_MOE, VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS), "
                 "which vLLM's defaults leave off: unfused")
