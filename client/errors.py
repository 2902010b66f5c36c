"""What a failed call raises: the status and the server's own message.

`field` is the request field the server blamed (trailing metadata
`loadplan-field`), so a caller can react without parsing the message.
"""

from __future__ import annotations

import grpc

FIELD_METADATA_KEY = "loadplan-field"


class RegistryCallError(Exception):
    """A call that did not succeed; `code` is the gRPC status name, e.g. "NOT_FOUND"."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.field = field


class InvalidArgumentError(RegistryCallError):
    pass


class NotFoundError(RegistryCallError):
    pass


class FailedPreconditionError(RegistryCallError):
    pass


class UnavailableError(RegistryCallError):
    pass


class DeadlineExceededError(RegistryCallError):
    pass


_BY_CODE: dict[str, type[RegistryCallError]] = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "NOT_FOUND": NotFoundError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "UNAVAILABLE": UnavailableError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
}


def error_for(code: str, message: str, field: str | None = None) -> RegistryCallError:
    return _BY_CODE.get(code, RegistryCallError)(code, message, field)


def from_rpc_error(err: grpc.RpcError) -> RegistryCallError:
    """Translate a grpc error (a `grpc.Call`) into the typed exception."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    message = (err.details() if hasattr(err, "details") else None) or str(err)
    field = None
    metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in metadata or ():
        if key == FIELD_METADATA_KEY:
            field = value
    return error_for(code.name if code is not None else "UNKNOWN", message, field)
