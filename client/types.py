"""Plain dataclasses the client returns besides `loadplan.plan.LoadPlan`."""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import PlanDiff  # noqa: F401 - re-exported: the client API returns it from diff_plans


@dataclass(frozen=True)
class BackendInfo:
    """One row of the registry's a2a backend capability table (DESIGN 5.1)."""

    name: str
    forward_path: str
    combine_reduces: bool
    deepep_class: bool
    per_rank_fused_slots: bool
    fusion_force_disabled: bool


@dataclass(frozen=True)
class CoverageEntry:
    entry_class: str
    known: bool
    family: str
    gated_family: bool
    has_gate: bool
    chain: tuple[str, ...]
    message: str
    ok: bool


@dataclass(frozen=True)
class CoverageReport:
    entries: list[CoverageEntry]
    ok: bool
