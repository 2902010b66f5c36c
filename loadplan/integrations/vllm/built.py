"""What vLLM is about to build, asked of vLLM's own decision code (vllm 0.31.0 and 0.32.0), as decision keys.

Each answer comes from the function vLLM's model files call, so the plugin compares the plan with
what vLLM really builds, not with a restatement:

- the fused-MoE parallel layout: `fused_moe/layer.py: make_parallel_config`, i.e.
  `FusedMoEParallelConfig.make` over the worker's groups (ep size/rank, use_all2all_kernels);
- the forward path: dispatch/combine kernels run iff `use_all2all_kernels` (or the experts' own
  `passthrough`);
- the reduction after the experts: `MoERunner._maybe_reduce_final_output` all-reduces iff
  (MoE tp_size > 1 or ep_size > 1) and the prepare/finalize object's `output_is_reduced()` is
  false, sequence parallel aside. Which prepare/finalize class is made restates the if-chain of
  `fused_moe/all2all_utils.py: maybe_make_prepare_finalize` (PREPARE_FINALIZE below); the answer
  is that class's own `output_is_reduced()`;
- shared-expert fusion: `fused_moe/utils.py: resolve_layer_fused_shared_expert`, in the model files
  that call it (FUSING_MODEL_FILES); every other model file builds its shared experts unfused;
- the pipeline stage's layers: `distributed/utils.py: get_pp_indices`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ...plan import Keys

FUSED_MOE = "vllm.model_executor.layers.fused_moe"

# maybe_make_prepare_finalize's branches in order (all2all_utils.py, lines 230-429 in 0.32.0): the
# first FusedMoEParallelConfig predicate that holds picks the class. The DeepEP, MoRI and NIXL-EP
# modules import their communication library at import time: on a machine without it vLLM cannot
# build that backend at all.
PREPARE_FINALIZE = (
    ("use_deepep_ht_kernels", "prepare_finalize.deepep_ht", "DeepEPHTPrepareAndFinalize"),
    ("use_deepep_ll_kernels", "prepare_finalize.deepep_ll", "DeepEPLLPrepareAndFinalize"),
    ("use_deepep_v2_kernels", "prepare_finalize.deepep_v2", "DeepEPV2PrepareAndFinalize"),
    ("use_moonep_kernels", "prepare_finalize.moonep", "MoonEPPrepareAndFinalize"),
    ("use_mori_kernels", "prepare_finalize.mori", "MoriPrepareAndFinalize"),
    ("use_fi_nvl_two_sided_kernels", "prepare_finalize.flashinfer_nvlink_two_sided",
     "FlashInferNVLinkTwoSidedPrepareAndFinalize"),
    ("use_fi_nvl_one_sided_kernels", "prepare_finalize.flashinfer_nvlink_one_sided",
     "FlashInferNVLinkOneSidedPrepareAndFinalize"),
    ("use_ag_rs_all2all_kernels", "prepare_finalize.naive_dp_ep", "MoEPrepareAndFinalizeNaiveDPEPModular"),
    ("use_nixl_ep_kernels", "prepare_finalize.nixl_ep", "NixlEPPrepareAndFinalize"),
)
PASSTHROUGH = ("prepare_finalize.passthrough", "PassThroughPrepareAndFinalize")
NO_ALL2ALL_DP = ("prepare_finalize.naive_dp_ep", "MoEPrepareAndFinalizeNaiveDPEPModular")
NO_ALL2ALL = ("prepare_finalize.no_dp_ep", "MoEPrepareAndFinalizeNoDPEPModular")

# The model files whose MoE block asks resolve_layer_fused_shared_expert (vllm 0.32.0;
# tests/integrations/vllm pins this list to the source). Wrappers (Kimi-VL, DeepSeek-VL2...)
# build their text body from these files.
FUSING_MODEL_FILES = frozenset({
    "vllm.model_executor.models.deepseek_v2",
    "vllm.model_executor.models.glm4_moe",
    "vllm.model_executor.models.AXK1",
    "vllm.model_executor.models.qwen3_next",
})


@dataclass(frozen=True)
class Built:
    """One thing vLLM is about to build: its value under the plan's key, and which code said so."""

    key: str
    value: Any
    source: str


class NotBuildableHere(RuntimeError):
    """vLLM's code for this choice cannot be imported on this machine (its library is missing)."""


def moe_parallel_config(parallel_config):
    """vLLM's FusedMoEParallelConfig for this worker, as FusedMoEFactory makes it."""
    from vllm.model_executor.layers.fused_moe.layer import make_parallel_config

    return make_parallel_config(tp_size=None, dp_size=None, pcp_size=None,
                                is_sequence_parallel=parallel_config.use_sequence_parallel_moe,
                                parallel_config=parallel_config)


def prepare_finalize_class(moe) -> type | None:
    """The prepare/finalize class maybe_make_prepare_finalize makes for `moe` (a
    FusedMoEParallelConfig); None where it makes none (the layer's own all2all manager combines)."""
    if getattr(moe, "use_passthrough_all2all", False):     # 0.32.0's; 0.31.0 has no passthrough
        where = PASSTHROUGH
    elif not moe.use_all2all_kernels:
        where = NO_ALL2ALL_DP if moe.dp_size > 1 else NO_ALL2ALL
    else:
        where = next(((module, name) for predicate, module, name in PREPARE_FINALIZE if getattr(moe, predicate)),
                     None)
        if where is None:
            return None
    module, name = where
    try:
        return getattr(importlib.import_module(f"{FUSED_MOE}.{module}"), name)
    except ImportError as e:
        raise NotBuildableHere(f"vLLM's {name} for all2all backend {moe.all2all_backend!r} cannot be imported "
                               f"here: {e}") from e


def output_is_reduced(cls: type | None) -> bool:
    """The class's own output_is_reduced(). The answer is a constant of the class: it is asked of an
    instance made without __init__, whose arguments are communication handles of its hardware."""
    if cls is None:
        return False
    return bool(cls.__new__(cls).output_is_reduced())


def forward_path(moe) -> str:
    return "a2a" if moe.use_all2all_kernels or getattr(moe, "use_passthrough_all2all", False) else "normal"


def post_experts_all_reduce(moe, reduced: bool) -> bool:
    """MoERunner._maybe_reduce_final_output's condition (sequence parallel reduces in the model)."""
    return not moe.is_sequence_parallel and (moe.tp_size > 1 or moe.ep_size > 1) and not reduced


def fused_shared_experts(model_class: type, quant_config, prefix: str) -> bool:
    if model_class.__module__ not in FUSING_MODEL_FILES:
        return False
    from vllm.model_executor.layers.fused_moe.utils import resolve_layer_fused_shared_expert

    return bool(resolve_layer_fused_shared_expert(quant_config, prefix))


def about_to_build(vllm_config, model_config, model_class: type) -> list[Built]:
    """What vLLM builds for this worker, by vLLM's own code. Inside a worker."""
    from vllm.distributed import get_pp_group
    from vllm.distributed.utils import get_pp_indices

    moe = moe_parallel_config(vllm_config.parallel_config)
    built = [Built(Keys.FORWARD_PATH, forward_path(moe),
                   f"FusedMoEParallelConfig.use_all2all_kernels={moe.use_all2all_kernels} "
                   f"(all2all backend {moe.all2all_backend}, ep_size={moe.ep_size}, dp_size={moe.dp_size})")]
    try:
        cls = prepare_finalize_class(moe)
    except NotBuildableHere:
        pass    # vLLM itself fails to build this backend here; nothing to compare
    else:
        reduced = output_is_reduced(cls)
        built.append(Built(Keys.POST_EXPERTS_ALL_REDUCE, post_experts_all_reduce(moe, reduced),
                           f"{getattr(cls, '__name__', 'no prepare/finalize')}.output_is_reduced()={reduced}, "
                           f"MoE tp_size={moe.tp_size}, ep_size={moe.ep_size}"))
    text = model_config.hf_text_config
    first_moe = getattr(text, "first_k_dense_replace", 0) or 0
    fused = fused_shared_experts(model_class, vllm_config.quant_config, f"model.layers.{first_moe}.mlp")
    built.append(Built(Keys.SHARED_EXPERTS_FUSION, fused,
                       f"resolve_layer_fused_shared_expert={fused}" if model_class.__module__ in FUSING_MODEL_FILES
                       else f"{model_class.__module__} builds its shared experts unfused"))
    n_layers = getattr(text, "num_hidden_layers", None)
    if n_layers is not None:
        pp = get_pp_group()
        start, end = get_pp_indices(n_layers, pp.rank_in_group, pp.world_size)
        built.append(Built(Keys.PP_LAYER_RANGE, [start, end],
                           f"get_pp_indices({n_layers}, {pp.rank_in_group}, {pp.world_size})"))
    return built
