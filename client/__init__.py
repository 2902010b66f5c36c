"""loadplan's typed gRPC client. Needs grpcio and protobuf only.

    from loadplan.client import RegistryClient
    with RegistryClient("127.0.0.1:50051") as client:
        plan = client.resolve_load_plan(request)
"""

from .errors import (DeadlineExceededError, FailedPreconditionError, InvalidArgumentError, NotFoundError,
                     RegistryCallError, UnavailableError)
from .registry_client import RegistryClient
from .types import BackendInfo, CoverageEntry, CoverageReport, PlanDiff

__all__ = [
    "RegistryClient", "RegistryCallError", "InvalidArgumentError", "NotFoundError", "FailedPreconditionError",
    "UnavailableError", "DeadlineExceededError", "PlanDiff", "BackendInfo", "CoverageEntry", "CoverageReport",
]
