"""Before an upgrade: which stored deployments an engine release would plan otherwise, or refuse.

Re-decides the recorded request of every runner of every stored deployment of `engine` (the newest plan of each
runner: its role and ranks) under release `to`, with the rules alone (nothing is written), and compares the
decisions with the stored ones. Pure: the plans come from the caller (the registry reads them from its store).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Iterable

from loadplan.errors import InvalidArgument, NotFound, RegistryError
from loadplan.plan import Keys, LoadPlan
from loadplan.upgrade import DecisionChange, DeploymentUpgrade, RoleUpgrade, UpgradeReport
from .rules.engines import ENGINES
from .rules.resolve import resolve_decisions

# Not compared: the release that decides (it is what changes), and decisions a runner appended after load (an EPLB
# rebalance's placement: revision > 0), which no release re-decides.
NOT_COMPARED = frozenset({Keys.ENGINE_PROFILE})


def check_upgrade(plans: Iterable[LoadPlan], engine: str, to: str, from_: str = "") -> UpgradeReport:
    if engine not in ENGINES:
        raise NotFound("engine", engine[:64], ENGINES, field="engine")
    releases = ENGINES[engine].releases
    if to not in releases:
        raise NotFound(f"release of {engine}", to[:64], releases, field="to_version")
    if from_ and from_ not in releases:
        raise NotFound(f"release of {engine}", from_[:64], releases, field="from_version")
    if from_ == to:
        raise InvalidArgument("from_version", f"is the target release {to}: nothing to check")
    newest: dict[tuple, LoadPlan] = {}
    for plan in plans:
        rt = plan.request.runtime
        if rt.engine != engine or rt.engine_version == to or (from_ and rt.engine_version != from_):
            continue
        key = (plan.request.deployment_id, plan.request.role, plan.request.parallel)
        if key not in newest or (plan.created_at, plan.plan_id) > (newest[key].created_at, newest[key].plan_id):
            newest[key] = plan
    by_deployment: dict[str, dict[str, list[LoadPlan]]] = defaultdict(lambda: defaultdict(list))
    for (deployment, role, _), plan in sorted(newest.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        by_deployment[deployment][role].append(plan)
    deployments = []
    for deployment, roles in sorted(by_deployment.items()):
        versions = sorted({p.request.runtime.engine_version for ps in roles.values() for p in ps})
        deployments.append(DeploymentUpgrade(deployment, tuple(versions),
                                             tuple(_role(role, ps, to) for role, ps in sorted(roles.items()))))
    return UpgradeReport(engine, to, from_, tuple(deployments))


def _role(role: str, plans: list[LoadPlan], to: str) -> RoleUpgrade:
    changes: dict[str, tuple] = {}       # key -> (before, after, runners)
    refusal, refused, hazard = "", 0, False
    for plan in plans:
        req = plan.request
        try:
            res = resolve_decisions(replace(req, runtime=replace(req.runtime, engine_version=to)))
        except RegistryError as e:
            refused += 1
            if not refusal:
                refusal, hazard = f"{e.code}: {e.message}", e.message.startswith("hazard:")
            continue
        stored = {k: d for k, d in plan.decisions.items() if d.revision == 0 and k not in NOT_COMPARED}
        fresh = {k: d for k, d in res.decisions.items() if k not in NOT_COMPARED}
        for key in sorted(stored.keys() | fresh.keys()):
            before, after = stored.get(key), fresh.get(key)
            if before is not None and after is not None and before.value == after.value:
                continue
            if key in changes:
                b, a, n = changes[key]
                changes[key] = (b, a, n + 1)
            else:
                changes[key] = (before, after, 1)
    return RoleUpgrade(role, len(plans), tuple(DecisionChange(k, b, a, n) for k, (b, a, n) in sorted(changes.items())),
                       refusal, refused, hazard)
