"""Shared-experts fusion gates: the families whose fusion depends on real conditions (DESIGN 5.2).

A family that never fuses is not here: its row in `entries.FAMILIES` says so (`never_fuses`, with its rule and
reason). A gate answers "why can this checkpoint NOT fuse its shared experts on this
runner?": a `Verdict` (rule id + reason) disables fusion, None allows it. The
caller has already applied what holds for every family (user intent, "no shared
experts", backends that force fusion off); a gate holds only its family's rules.

`ctx.enforced` (enforce_shared_experts_fusion) skips a gate's optional
conditions, never the structural ones, which would mis-load weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadplan.config_view import ConfigView
from loadplan.layouts import MoeLayout
from loadplan.plan import Parallel, Runtime
from .backends import BackendCapabilities
from .devices import GLM4_FUSED_KERNEL_MIN, Device, runs_fused_kernel, runs_fused_slots_under_ep
from .quantization import NO_FUSION_QUANTIZATIONS, Quantization


@dataclass(frozen=True)
class Verdict:
    rule: str
    reason: str


@dataclass(frozen=True)
class GateContext:
    entry_class: str            # the class being built (the inner one, for a wrapper)
    fused_architecture: str     # the architecture this family fuses for
    cfg: ConfigView             # the config the constructor receives
    layout: MoeLayout
    quantization: Quantization  # the quantization the constructor receives
    runtime: Runtime
    parallel: Parallel
    backend: BackendCapabilities
    device: Device
    runner: str                 # the engine's MoE runner: "torch" or "kernel" (service/rules/engines.py)

    @property
    def enforced(self) -> bool:
        return self.runtime.enforce_shared_experts_fusion



def deepseek_gate(ctx: GateContext) -> Verdict | None:
    rt, lay, q = ctx.runtime, ctx.layout, ctx.quantization
    # 3. overlap schedulers
    if not ctx.enforced and (rt.enable_sbo or rt.enable_tbo):
        return Verdict("deepseek.overlap", "SBO/TBO enabled: incompatible with fusing the shared expert "
                                           "into the MoE kernel")
    # 4. structural: never skipped, the weights would be mis-loaded
    if ctx.entry_class != ctx.fused_architecture:
        return Verdict("deepseek.structural.architecture",
                       f"{ctx.entry_class} is not the fused architecture {ctx.fused_architecture}")
    if lay.n_routed not in (256, 384):
        return Verdict("deepseek.structural.n_routed_experts",
                       f"n_routed_experts={lay.n_routed}: the fused layout exists for 256 or 384 only")
    if lay.n_shared != 1:
        return Verdict("deepseek.structural.n_shared_experts",
                       f"n_shared_experts={lay.n_shared}: the fused layout holds exactly one shared expert")
    if lay.n_routed == 384 and q.name != "quark":
        return Verdict("deepseek.structural.384_needs_quark",
                       f"384 routed experts with quantization {q.name or 'none'}: the 384-expert layout is "
                       f"pre-fused only in quark checkpoints; anything else would mis-load the shared expert")
    if ctx.enforced:
        return None
    # 5. DeepEP-class a2a backends
    if ctx.backend.deepep_class:
        return Verdict("deepseek.deepep_class",
                       f"a2a backend {ctx.backend.name} is DeepEP-class: fusion is off by default "
                       f"(enforce_shared_experts_fusion turns it on)")
    # 6. device
    if not runs_fused_kernel(ctx.runner, ctx.device):
        return Verdict("deepseek.device", f"MoE runner {ctx.runner} on {ctx.device} cannot run the fused "
                                          f"kernel (needs cuda>=8.0, hip>=9.4, musa>=3.1 or the torch runner)")
    # 7. expert parallelism
    if ctx.parallel.ep_size > 1 and not runs_fused_slots_under_ep(ctx.runner, ctx.device):
        return Verdict("deepseek.expert_parallel",
                       f"ep_size={ctx.parallel.ep_size}: MoE runner {ctx.runner} on {ctx.device} cannot run "
                       f"fused slots under expert parallelism (needs hip>=9.4 or the torch runner)")
    # 8. quantization
    if q.name in NO_FUSION_QUANTIZATIONS:
        return Verdict("deepseek.quantization", f"quantization {q.name} has no fused shared-expert kernel")
    return None


def glm4_moe_gate(ctx: GateContext) -> Verdict | None:
    lay, q = ctx.layout, ctx.quantization
    if ctx.entry_class != ctx.fused_architecture:
        return Verdict("glm4_moe.structural.architecture",
                       f"{ctx.entry_class} is not the fused architecture {ctx.fused_architecture}")
    if lay.n_shared != 1:
        return Verdict("glm4_moe.structural.n_shared_experts",
                       f"n_shared_experts={lay.n_shared}: the fused layout holds exactly one shared expert")
    if q.name == "modelopt_fp4" and q.excludes("shared_experts"):
        return Verdict("glm4_moe.structural.modelopt_fp4_excludes_shared",
                       "ModelOpt FP4 checkpoint excludes the shared experts from quantization: a fused slot "
                       "would mix quantized routed and unquantized shared weights")
    if ctx.enforced:
        return None
    if not runs_fused_kernel(ctx.runner, ctx.device, GLM4_FUSED_KERNEL_MIN):
        return Verdict("glm4_moe.device", f"MoE runner {ctx.runner} on {ctx.device} cannot run the fused "
                                          f"kernel (needs cuda>=8.0, hip>=9.4 or the torch runner)")
    if ctx.parallel.ep_size > 1 and not runs_fused_slots_under_ep(ctx.runner, ctx.device):
        return Verdict("glm4_moe.expert_parallel",
                       f"ep_size={ctx.parallel.ep_size}: MoE runner {ctx.runner} on {ctx.device} cannot run "
                       f"fused slots under expert parallelism (needs hip>=9.4 or the torch runner)")
    if ctx.backend.deepep_class:
        return Verdict("glm4_moe.deepep_class",
                       f"a2a backend {ctx.backend.name} is DeepEP-class: fusion is off by default")
    if q.name == "w4afp8":
        return Verdict("glm4_moe.quantization", "quantization w4afp8 has no fused shared-expert kernel")
    return None


def qwen2_moe_gate(ctx: GateContext) -> Verdict | None:
    # Both required: left out, the reference reads its config class's default widths, which differ between the
    # families this gate serves (Qwen2-MoE's 5632 and 1408, Qwen3-Next's and Qwen3.5's 512 and 512).
    shared = ctx.cfg.int("shared_expert_intermediate_size")
    routed = ctx.cfg.int("moe_intermediate_size")
    if shared != routed:
        return Verdict("qwen2_moe.structural.intermediate_size",
                       f"shared_expert_intermediate_size={shared} != moe_intermediate_size={routed}: "
                       f"the shared expert does not fit a routed-expert slot")
    if ctx.enforced:
        return None
    if ctx.backend.deepep_class:
        return Verdict("qwen2_moe.deepep_class",
                       f"a2a backend {ctx.backend.name} is DeepEP-class: fusion is off by default")
    if ctx.quantization.name in NO_FUSION_QUANTIZATIONS:
        return Verdict("qwen2_moe.quantization",
                       f"quantization {ctx.quantization.name} has no fused shared-expert kernel")
    return None
