"""The a2a backend capability table (DESIGN 5.1). One row per accepted backend.

A backend not in this table is a request error, never a fallback to `normal`.
Model code never names a backend: it reads the decisions derived from a row.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadplan.errors import NotFound

NORMAL = "normal"
A2A = "a2a"


@dataclass(frozen=True)
class BackendCapabilities:
    name: str
    forward_path: str            # NORMAL or A2A
    combine_reduces: bool        # the combine already sums expert outputs
    deepep_class: bool           # shared-experts fusion off by default
    per_rank_fused_slots: bool   # can hold a fused shared slot on every rank under EP
    fusion_force_disabled: bool = False  # fusion off even when enforced


@dataclass(frozen=True)
class Forward:
    """How an engine's MoE layer runs its experts (`moe.forward_path`: NORMAL or A2A) and whether the layer
    reduces after them (`moe.post_experts_all_reduce`), with the rule and reason of both decisions."""
    path: str
    all_reduce: bool
    rule: str
    reason: str


BACKENDS: dict[str, BackendCapabilities] = {
    row.name: row
    for row in (
        BackendCapabilities("none", NORMAL, combine_reduces=False, deepep_class=False, per_rank_fused_slots=False),
        BackendCapabilities("deepep", A2A, combine_reduces=True, deepep_class=True, per_rank_fused_slots=True),
        BackendCapabilities("mooncake", A2A, combine_reduces=True, deepep_class=True, per_rank_fused_slots=True),
        BackendCapabilities("mori", A2A, combine_reduces=True, deepep_class=True, per_rank_fused_slots=True),
        BackendCapabilities("nixl", A2A, combine_reduces=True, deepep_class=False, per_rank_fused_slots=False),
        BackendCapabilities("ascend_fuseep", A2A, combine_reduces=True, deepep_class=False,
                            per_rank_fused_slots=False),
        BackendCapabilities("flashinfer", A2A, combine_reduces=True, deepep_class=False, per_rank_fused_slots=False,
                            fusion_force_disabled=True),
        BackendCapabilities("megamoe", A2A, combine_reduces=True, deepep_class=False, per_rank_fused_slots=True),
    )
}


def backend(name: str) -> BackendCapabilities:
    """The row of `name`; NOT_FOUND listing the known backends otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise NotFound("a2a backend", name, BACKENDS, field="runtime.a2a_backend") from None
