"""Hazards (DESIGN 8.3): layouts an engine's own code would run wrong. One table; the registry refuses them.

A profile reproduces its engine, except here: where the engine's code would reduce twice, count a shared expert
twice or drop it, or mis-load weights, the plan is refused with FAILED_PRECONDITION beginning `hazard:`, naming
the engine's code path and a safe alternative. Each row has a test showing, on loadplan's engine, that the layout
it prevents changes the logits (tests/engine/test_hazards.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from loadplan.errors import FailedPrecondition


@dataclass(frozen=True)
class Hazard:
    id: str
    engine: str
    code_path: str       # where the engine's code runs the wrong layout
    wrong: str           # what goes wrong
    safe: str            # a layout that runs right

    def refuse(self, detail: str) -> FailedPrecondition:
        return FailedPrecondition(f"hazard: {self.id}: {detail}: {self.code_path} {self.wrong}; safe alternative: "
                                  f"{self.safe}")


HAZARDS: dict[str, Hazard] = {
    h.id: h
    for h in (
        Hazard("sglang.double_reduction", "sglang",
               "sglang/srt/models/<family>.py normal branch (reduce_moe_output) after the experts layer's "
               "MaybeTboDeepEPDispatcher/DeepEPv2Dispatcher combine",
               "all-reduces an output the combine already summed: every token's expert output is counted "
               "ep_size times (a double reduction)",
               "an a2a backend this family's block dispatches itself (its dispatch branch), or "
               "--moe-a2a-backend none"),
        Hazard("sglang.fused_global_slot_on_dispatch", "sglang",
               "sglang/srt/models/deepseek_v2.py DeepseekV2MoE dispatch branch with a fused shared slot on a backend "
               "without per-rank fused slots (uses_per_rank_fused_shared_slots() false)",
               "dispatches the global shared-expert slot to one rank's experts: each token's shared expert is "
               "dropped on the other ranks' tokens or counted once per rank",
               "leave --enforce-shared-experts-fusion off (the gate then keeps the shared expert unfused), or a "
               "DeepEP-class backend (deepep, mooncake, mori), whose ranks each hold a fused slot"),
        Hazard("sglang.enforced_384_without_quark", "sglang",
               "sglang/srt/models/deepseek_v2.py shared_experts_fusion_disable_reason with "
               "--enforce-shared-experts-fusion on a 384-expert checkpoint that is not Quark",
               "loads the loose shared expert into the pre-fused slot 384 (SGLang's own comment: 'the fused path "
               "silently mis-loads it')",
               "leave --enforce-shared-experts-fusion off, or a Quark MXFP4 checkpoint (amd/Kimi-K2.5-MXFP4), the "
               "only pre-fused 384-expert layout"),
    )
}


def refuse(hazard_id: str, detail: str) -> FailedPrecondition:
    return HAZARDS[hazard_id].refuse(detail)
