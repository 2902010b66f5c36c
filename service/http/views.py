"""What the web view's pages show, built from the registry's read methods alone.

Every function takes the use case (`service.registry.Registry`: `get_plan`,
`list_plans`, `diff_plans`) and returns plain data for a template; nothing here
writes, renders HTML or knows HTTP. The pages are an audit of the history:
deployments, a deployment's runners and whether its ranks agree, a plan, a diff,
and a runner's EPLB rebalances (AppendDecisions revisions).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any, Iterator

from loadplan.plan import ROLE_SPECULATIVE, ROLE_TARGET, Decision, LoadPlan, Parallel
from ..registry import MAX_PAGE_SIZE, PlanFilter, Registry

# The deployment list reads at most this many plans, newest first (a page of the list: its
# "older" link continues below the oldest one read). A deployment's page reads all its plans
# up to DEPLOYMENT_PLANS.
SCAN_PLANS = 2000
DEPLOYMENT_PLANS = 5000
EPLB_PREFIX = "eplb."


def value_text(value: Any) -> str:
    """A decision value as JSON, the way the CLI and the wire write it."""
    return json.dumps(value, sort_keys=True, separators=(", ", ": "))


def plans(registry: Registry, flt: PlanFilter, limit: int) -> Iterator[LoadPlan]:
    """Plans matching `flt`, newest first, at most `limit` (page by page)."""
    token, seen = None, 0
    while seen < limit:
        page, token = registry.list_plans(flt, min(MAX_PAGE_SIZE, limit - seen), token)
        for p in page:
            yield p
        seen += len(page)
        if not token or not page:
            return


@dataclass
class DeploymentRow:
    deployment_id: str
    models: set[str] = field(default_factory=set)
    roles: set[str] = field(default_factory=set)
    runners: int = 0
    first: dt.datetime | None = None
    latest: dt.datetime | None = None


@dataclass
class DeploymentList:
    rows: list[DeploymentRow]
    scanned: int
    truncated: bool                  # more plans matched than were read
    older_before: dt.datetime | None  # the "older" link's created_before


def deployments(registry: Registry, model: str = "", after: dt.datetime | None = None,
                before: dt.datetime | None = None, scan: int = SCAN_PLANS) -> DeploymentList:
    """Deployments with a plan in [after, before), newest activity first. `model`: a part of the
    entry class (case-insensitive: "deepseek" finds DeepseekV3ForCausalLM)."""
    needle = model.strip().lower()
    rows: dict[str, DeploymentRow] = {}
    scanned, oldest = 0, None
    for p in plans(registry, PlanFilter(created_after=after, created_before=before), scan + 1):
        if scanned == scan:
            return DeploymentList(list(rows.values()), scanned, True, oldest)
        scanned += 1
        oldest = p.created_at
        if needle and needle not in p.entry_class.lower():
            continue
        row = rows.setdefault(p.request.deployment_id, DeploymentRow(p.request.deployment_id))
        row.models.add(p.entry_class)
        row.roles.add(p.request.role)
        row.runners += 1
        row.latest = row.latest or p.created_at
        row.first = p.created_at
    return DeploymentList(list(rows.values()), scanned, False, None)


def rank_of(p: Parallel) -> tuple[int, int, int, int]:
    return (p.pp_rank, p.dp_rank, p.ep_rank, p.tp_rank)


def rank_text(p: Parallel) -> str:
    return (f"pp {p.pp_rank}/{p.pp_size} · dp {p.dp_rank}/{p.dp_size} · ep {p.ep_rank}/{p.ep_size} · "
            f"tp {p.tp_rank}/{p.tp_size}")


@dataclass
class RoleGroup:
    role: str
    plans: list[LoadPlan]
    agree: bool
    disagreeing: list[str]           # deployment-wide keys whose value differs between ranks
    shared: list[Decision]           # the deployment-wide decisions of the first rank, for reference


@dataclass
class Deployment:
    deployment_id: str
    groups: list[RoleGroup]
    pairs: list[tuple[LoadPlan, LoadPlan]]    # (target, draft) of the same ranks: the diff links
    truncated: bool


def deployment(registry: Registry, deployment_id: str, limit: int = DEPLOYMENT_PLANS) -> Deployment:
    """A deployment's runners by role and rank, whether each role's ranks agree on the
    deployment-wide decisions, and each draft paired with its target."""
    found = list(plans(registry, PlanFilter(deployment_id=deployment_id), limit + 1))
    truncated = len(found) > limit
    found = found[:limit]
    by_role: dict[str, list[LoadPlan]] = {}
    for p in found:
        by_role.setdefault(p.request.role, []).append(p)
    groups = []
    for role in sorted(by_role, key=lambda r: (r != ROLE_TARGET, r)):
        members = sorted(by_role[role], key=lambda p: (rank_of(p.request.parallel), p.created_at))
        groups.append(_role_group(role, members))
    targets = {rank_of(p.request.parallel): p for p in by_role.get(ROLE_TARGET, [])}
    first_target = next(iter(targets.values()), None)
    pairs = []
    for draft in by_role.get(ROLE_SPECULATIVE, []):
        target = target_of(draft, targets, first_target)
        if target is not None:
            pairs.append((target, draft))
    pairs.sort(key=lambda tp: rank_of(tp[1].request.parallel))
    return Deployment(deployment_id, groups, pairs, truncated)


def _role_group(role: str, members: list[LoadPlan]) -> RoleGroup:
    values: dict[str, set[str]] = {}
    for p in members:
        for key, d in p.decisions.items():
            if d.deployment_wide:
                values.setdefault(key, set()).add(value_text(d.value))
    # A key some ranks lack disagrees too (a deployment-wide decision is every rank's).
    counts = {k: sum(1 for p in members if k in p.decisions) for k in values}
    disagreeing = sorted(k for k, v in values.items() if len(v) > 1 or counts[k] != len(members))
    shared = sorted((d for d in members[0].decisions.values() if d.deployment_wide), key=lambda d: d.key)
    return RoleGroup(role, members, not disagreeing, disagreeing, shared)


def target_of(draft: LoadPlan, targets: dict[tuple, LoadPlan], fallback: LoadPlan | None) -> LoadPlan | None:
    """The target plan a draft runs beside: the one of its ranks, else the deployment's first."""
    return targets.get(rank_of(draft.request.parallel), fallback)


def draft_target(registry: Registry, draft: LoadPlan) -> LoadPlan | None:
    """For a plan's page: the target of the same deployment and ranks (None: not a draft, or none)."""
    if draft.request.role != ROLE_SPECULATIVE:
        return None
    targets: dict[tuple, LoadPlan] = {}
    for p in plans(registry, PlanFilter(deployment_id=draft.request.deployment_id, role=ROLE_TARGET),
                   DEPLOYMENT_PLANS):
        targets.setdefault(rank_of(p.request.parallel), p)
    return target_of(draft, targets, next(iter(targets.values()), None))


def inputs(p: LoadPlan) -> list[tuple[str, Any]]:
    """What the plan was decided from, as (field, value) rows."""
    req = p.request
    rows: list[tuple[str, Any]] = [
        ("deployment_id", req.deployment_id), ("request_id", req.request_id), ("role", req.role),
        ("host", req.host or "—"), ("entry_class", p.entry_class),
        ("quantization", p.quantization or "none"),
        ("requested quantization", req.quantization or "—"),
        ("config_fingerprint", p.config_fingerprint), ("ruleset_version", p.ruleset_version),
    ]
    rows += [(f"parallel.{k}", getattr(req.parallel, k)) for k in req.parallel.__dataclass_fields__]
    rows += [(f"runtime.{k}", getattr(req.runtime, k)) for k in req.runtime.__dataclass_fields__]
    return rows


@dataclass
class Rebalance:
    step: int                       # 0: as resolved; then one per AppendDecisions, in order
    decided_at: dt.datetime | None
    decisions: list[Decision]


def rebalances(p: LoadPlan) -> list[Rebalance]:
    """The EPLB decisions of a plan read with its history, one group per moment they were decided:
    the resolve, then each AppendDecisions (all of one call's decisions share its time), oldest
    first. A key's own `revision` counts its appends; a key first appended later (a placement the
    resolve left to the engine) starts at 0 there."""
    by_time: dict[dt.datetime | None, list[Decision]] = {}
    for d in p.history or tuple(p.decisions.values()):
        if d.key.startswith(EPLB_PREFIX):
            by_time.setdefault(d.decided_at, []).append(d)
    resolved = by_time.pop(p.created_at, [])
    out = [Rebalance(0, p.created_at, sorted(resolved, key=lambda d: d.key))] if resolved else []
    later = sorted(by_time.items(), key=lambda kv: (kv[0] is not None, kv[0] or p.created_at))
    for step, (when, ds) in enumerate(later, start=1):
        out.append(Rebalance(step, when, sorted(ds, key=lambda d: d.key)))
    return out
