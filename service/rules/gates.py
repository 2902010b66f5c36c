"""Shared-experts fusion gates, one small function per family (DESIGN 5.2).

A gate answers "why can this checkpoint NOT fuse its shared experts on this
runner?": a `Verdict` (rule id + reason) disables fusion, None allows it. The
caller has already applied what holds for every family (user intent, "no shared
experts", backends that force fusion off); a gate holds only its family's rules.

`ctx.enforced` (enforce_shared_experts_fusion) skips a gate's optional
conditions, never the structural ones, which would mis-load weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from .backends import BackendCapabilities
from .config_view import ConfigView
from .devices import GLM4_FUSED_KERNEL_MIN, Device, runs_fused_kernel, runs_fused_slots_under_ep
from .layouts import MoeLayout
from .quantization import NO_FUSION_QUANTIZATIONS, Quantization
from ...plan import Parallel, Runtime


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


def llama4_gate(ctx: GateContext) -> Verdict | None:
    """Llama 4 never fuses (not in DESIGN 5.2; our choice): its routed experts take their input scaled by the
    router score, so a fused slot could not carry the normal path's 1/ep_size share as a routing weight (the
    experts are not linear), and no checkpoint or kernel has a fused layout for it. Structural: enforce does
    not skip it."""
    return Verdict("llama4.structural.input_scaled_experts",
                   "its routed experts scale their input by the router score: a shared expert fused as a routed "
                   "slot would not count once (no fused layout exists for Llama 4)")


def ernie4_5_moe_gate(ctx: GateContext) -> Verdict | None:
    """ERNIE-4.5 never fuses (not in DESIGN 5.2; our choice, as SGLang and vLLM run it): no checkpoint or kernel has
    a fused layout for its shared experts (the published models ship 2, one MLP twice as wide as an expert, which
    no single expert slot can hold). Structural: enforce does not skip it."""
    return Verdict("ernie4_5_moe.structural.no_fused_layout",
                   f"its {ctx.layout.n_shared} shared expert(s) run beside the routed experts: no fused layout exists "
                   f"for ERNIE-4.5")


def granitemoe_shared_gate(ctx: GateContext) -> Verdict | None:
    """GraniteMoeShared never fuses (not in DESIGN 5.2; our choice, as SGLang and vLLM run it): its shared MLP is
    sized on its own (`shared_intermediate_size`), with no fused layout or kernel. Structural: enforce does not
    skip it."""
    return Verdict("granitemoe_shared.structural.no_fused_layout",
                   "its shared MLP runs beside the routed experts: no fused layout exists for Granite MoE")


def afmoe_gate(ctx: GateContext) -> Verdict | None:
    """AFMoE never fuses (not in DESIGN 5.2; our choice, as SGLang and vLLM run it): its shared experts run beside
    the routed ones, with no fused layout or kernel. Structural: enforce does not skip it."""
    return Verdict("afmoe.structural.no_fused_layout",
                   f"its {ctx.layout.n_shared} shared expert(s) run beside the routed experts: no fused layout exists "
                   f"for AFMoE")


def exaone_moe_gate(ctx: GateContext) -> Verdict | None:
    """EXAONE-MoE never fuses (not in DESIGN 5.2; our choice, as SGLang and vLLM run it): its shared experts run
    beside the routed ones, with no fused layout or kernel. Structural: enforce does not skip it."""
    return Verdict("exaone_moe.structural.no_fused_layout",
                   f"its {ctx.layout.n_shared} shared expert(s) run beside the routed experts: no fused layout exists "
                   f"for EXAONE-MoE")


def kimi_linear_gate(ctx: GateContext) -> Verdict | None:
    """Kimi-Linear never fuses (not in DESIGN 5.2; our choice): DeepSeek-V3's MoE block, but its own family, whose
    shared experts run beside the routed ones with no fused layout. Structural: enforce does not skip it."""
    return Verdict("kimi_linear.structural.no_fused_layout",
                   f"its {ctx.layout.n_shared} shared expert(s) run beside the routed experts: no fused layout exists "
                   f"for Kimi-Linear")


def bailing_hybrid_gate(ctx: GateContext) -> Verdict | None:
    """The Ling 3 hybrids never fuse (not in DESIGN 5.2; our choice), as Kimi-Linear (`kimi_linear_gate`)."""
    return Verdict("bailing_hybrid.structural.no_fused_layout",
                   f"its {ctx.layout.n_shared} shared expert(s) run beside the routed experts: no fused layout exists "
                   f"for the Ling hybrids")


def solar_open_gate(ctx: GateContext) -> Verdict | None:
    """Solar Open never fuses (not in DESIGN 5.2; our choice): GLM-4-MoE's MoE block, but its own family, whose shared
    experts run beside the routed ones with no fused layout. Structural: enforce does not skip it."""
    return Verdict("solar_open.structural.no_fused_layout",
                   f"its {ctx.layout.n_shared} shared expert(s) run beside the routed experts: no fused layout exists "
                   f"for Solar Open")


def granitemoe_swa_gate(ctx: GateContext) -> Verdict | None:
    """Granite MoE SWA never fuses its shared MLP, as GraniteMoeShared (`granitemoe_shared_gate`)."""
    return Verdict("granitemoe_swa.structural.no_fused_layout",
                   "its shared MLP runs beside the routed experts: no fused layout exists for Granite MoE SWA")


def granitemoe_hybrid_gate(ctx: GateContext) -> Verdict | None:
    """Granite 4.0-H never fuses its shared MLP, as GraniteMoeShared (`granitemoe_shared_gate`)."""
    return Verdict("granitemoe_hybrid.structural.no_fused_layout",
                   "its shared MLP runs beside the routed experts: no fused layout exists for Granite 4.0-H")


def nemotron_h_gate(ctx: GateContext) -> Verdict | None:
    """Nemotron-H never fuses (not in DESIGN 5.2; our choice, as SGLang and vLLM run it): its shared MLP is sized on
    its own and its experts have no gate, so no fused layout or kernel exists. Structural: enforce does not skip
    it."""
    return Verdict("nemotron_h.structural.no_fused_layout",
                   "its shared MLP runs beside the routed experts: no fused layout exists for Nemotron-H")


def cohere2_moe_gate(ctx: GateContext) -> Verdict | None:
    """Cohere2-MoE never fuses (not in DESIGN 5.2; our choice, as transformers runs it): its shared experts' output is
    summed with the routed experts' or averaged with it, with no fused layout or kernel. Structural: enforce does not
    skip it."""
    return Verdict("cohere2_moe.structural.no_fused_layout",
                   f"its {ctx.layout.n_shared} shared expert(s) run beside the routed experts: no fused layout exists "
                   f"for Cohere2-MoE")


def step3p5_gate(ctx: GateContext) -> Verdict | None:
    """Step-3.5 never fuses (not in DESIGN 5.2; our choice): its shared expert is as wide as share_expert_dim says, not
    as a routed expert, and clamps on its own bounds, so no fused layout exists. Structural: enforce does not skip
    it."""
    return Verdict("step3p5.structural.no_fused_layout",
                   "its shared expert runs beside the routed experts (its own width and clamps): no fused layout "
                   "exists for Step-3.5")


def hy_v3_gate(ctx: GateContext) -> Verdict | None:
    """HY-V3 never fuses (not in DESIGN 5.2; our choice, as EXAONE-MoE's: DeepSeek-V3's block under a family of its
    own, no fused layout for it). Structural: enforce does not skip it."""
    return Verdict("hy_v3.structural.no_fused_layout",
                   f"its {ctx.layout.n_shared} shared expert(s) run beside the routed experts: no fused layout exists "
                   f"for HY-V3")


def laguna_gate(ctx: GateContext) -> Verdict | None:
    """Laguna never fuses (not in DESIGN 5.2; our choice): its shared expert is as wide as
    shared_expert_intermediate_size says, not as a routed expert. Structural: enforce does not skip it."""
    return Verdict("laguna.structural.no_fused_layout",
                   "its shared expert runs beside the routed experts (its own width): no fused layout exists for "
                   "Laguna")


def flint_gate(ctx: GateContext) -> Verdict | None:
    """Flint never fuses (not in DESIGN 5.2; our choice): its ungated shared expert is as wide as
    shared_expert_intermediate_size says, not as a routed expert. Structural: enforce does not skip it."""
    return Verdict("flint.structural.no_fused_layout",
                   "its shared expert runs beside the routed experts (its own width): no fused layout exists for Flint")


def kolibri1_gate(ctx: GateContext) -> Verdict | None:
    """Kolibri-1 never fuses (not in DESIGN 5.2; our choice), as Flint: its ungated shared expert is as wide as
    shared_expert_intermediate_size says. Structural: enforce does not skip it."""
    return Verdict("kolibri1.structural.no_fused_layout",
                   "its shared expert runs beside the routed experts (its own width): no fused layout exists for "
                   "Kolibri-1")


def hunyuan_v1_moe_gate(ctx: GateContext) -> Verdict | None:
    """Hunyuan never fuses (not in DESIGN 5.2; our choice, as SGLang and vLLM run it): its shared MLP runs beside the
    routed experts, ungated, with no fused layout or kernel. Structural: enforce does not skip it."""
    return Verdict("hunyuan_v1_moe.structural.no_fused_layout",
                   "its shared MLP runs beside the routed experts: no fused layout exists for Hunyuan")


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
    rt, lay, q = ctx.runtime, ctx.layout, ctx.quantization
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
    shared = ctx.cfg.int("shared_expert_intermediate_size", 0)
    routed = ctx.cfg.int("moe_intermediate_size", 0)
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
