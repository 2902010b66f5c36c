"""Plain dataclasses the client returns besides `loadplan.plan.LoadPlan`."""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import PlanDiff  # noqa: F401 - re-exported: the client API returns it from diff_plans


@dataclass(frozen=True)
class BackendInfo:
    """One row of an engine's a2a backend table, as the registry's profile of that engine and release holds it."""

    name: str
    forward_path: str
    combine_reduces: bool
    deepep_class: bool
    per_rank_fused_slots: bool
    fusion_force_disabled: bool
    accepted: bool = True          # the registry plans on it for this engine (false: the engine names it only)
    note: str = ""
    engine: str = ""               # the engine and release the table is of
    engine_version: str = ""


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


@dataclass(frozen=True)
class Candidate:
    """One a2a backend or MoE runner tried in a runner's place: whether its engine would start with it, and why."""

    name: str
    starts: bool
    reason: str
    forward_path: str = ""
    shared_experts_fusion: bool = False


@dataclass(frozen=True)
class CapabilityReport:
    engine: str
    engine_version: str
    backends: tuple[Candidate, ...]
    moe_runners: tuple[Candidate, ...]
