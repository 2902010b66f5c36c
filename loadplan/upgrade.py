"""An upgrade check's answer: what every stored deployment would be planned under another engine release.

Pure dataclasses shared by the registry (service/upgrade_check.py decides them), the transport, the client and the
CLI (`loadplan upgrade-check`): per deployment and role, the decisions that change (value, reason and rule on both
sides), and the runners the target release would refuse (a hazard among them), or nothing at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .plan import Decision

UNCHANGED, CHANGES, REFUSED, HAZARD = "unchanged", "changes", "refused", "hazard"


@dataclass(frozen=True)
class DecisionChange:
    key: str
    before: Decision | None          # the stored plan's decision (None: the key is new)
    after: Decision | None           # the target release's (None: the key goes away)
    runners: int = 1                 # how many of the role's runners it changes for


@dataclass(frozen=True)
class RoleUpgrade:
    role: str
    runners: int                              # runners of this role checked (the newest plan of each)
    changes: tuple[DecisionChange, ...] = ()
    refusal: str = ""                         # the target release's refusal of the first refused runner
    refused_runners: int = 0
    hazard: bool = False                      # that refusal is a hazard (DESIGN 8.3)

    @property
    def status(self) -> str:
        if self.refusal:
            return HAZARD if self.hazard else REFUSED
        return CHANGES if self.changes else UNCHANGED


@dataclass(frozen=True)
class DeploymentUpgrade:
    deployment_id: str
    from_versions: tuple[str, ...]            # the releases its stored plans were decided by
    roles: tuple[RoleUpgrade, ...] = ()

    @property
    def status(self) -> str:
        """The worst of its roles: hazard, refused, changes, unchanged."""
        order = (HAZARD, REFUSED, CHANGES, UNCHANGED)
        return min((r.status for r in self.roles), key=order.index, default=UNCHANGED)


@dataclass(frozen=True)
class UpgradeReport:
    engine: str
    to_version: str
    from_version: str = ""                    # "" : every stored release of the engine but the target
    deployments: tuple[DeploymentUpgrade, ...] = field(default_factory=tuple)

    @property
    def blocked(self) -> bool:
        """Whether any deployment would be refused or hit a hazard under the target release."""
        return any(d.status in (HAZARD, REFUSED) for d in self.deployments)
