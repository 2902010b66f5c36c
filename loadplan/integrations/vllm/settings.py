"""What turns the plugin on, read from the environment of each vLLM process.

    LOADPLAN_REGISTRY     host:port of the registry; unset or empty: the plugin does nothing
    LOADPLAN_DEPLOYMENT   the deployment id every rank of this vLLM deployment shares
                          (default: derived from the model and the parallel layout, identity.py)
    LOADPLAN_UPGRADE_FROM an upgrade the operator names on the upgraded replicas: the vLLM release the
                          deployment's other runners run (they may share it while the layout agrees)

The bearer token and TLS files are the client's own variables ($LOADPLAN_TOKEN,
$LOADPLAN_TOKEN_FILE, $LOADPLAN_TLS_CA, $LOADPLAN_TLS_CERT, $LOADPLAN_TLS_KEY: client/auth.py),
read by `RegistryClient` itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

REGISTRY_ENV = "LOADPLAN_REGISTRY"
DEPLOYMENT_ENV = "LOADPLAN_DEPLOYMENT"
UPGRADE_FROM_ENV = "LOADPLAN_UPGRADE_FROM"


@dataclass(frozen=True)
class Settings:
    registry: str
    deployment: str | None
    upgrade_from: str = ""


def settings_from(environ: Mapping[str, str] = os.environ) -> Settings | None:
    """The plugin's settings, or None when $LOADPLAN_REGISTRY is unset (inert)."""
    registry = environ.get(REGISTRY_ENV, "").strip()
    if not registry:
        return None
    deployment = environ.get(DEPLOYMENT_ENV, "").strip() or None
    return Settings(registry=registry, deployment=deployment,
                    upgrade_from=environ.get(UPGRADE_FROM_ENV, "").strip())
