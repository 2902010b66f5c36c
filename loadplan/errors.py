"""Domain errors. The transport maps each to one gRPC status (DESIGN section 7).

They live here, free of grpc, so the rules and the store can raise them.
"""

from __future__ import annotations

from typing import Iterable


class RegistryError(Exception):
    """Base class; `field` names the offending request field when there is one."""

    code = "UNKNOWN"

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return self.message


class InvalidArgument(RegistryError):
    """Malformed request or config. The message starts with the field's path."""

    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}", field=field)


class NotFound(RegistryError):
    """Unknown entry class, backend or plan; lists the known ones when there are."""

    code = "NOT_FOUND"

    def __init__(self, what: str, name: str, known: Iterable[str] = (), *, field: str | None = None):
        known = sorted(known)
        hint = f"; supported: {', '.join(known)}" if known else ""
        super().__init__(f"{what} {name!r} is not supported{hint}" if known else f"{what} {name!r} not found",
                         field=field)
        self.known = known


class FailedPrecondition(RegistryError):
    """A combination that cannot be honoured (e.g. ranks of one deployment disagree)."""

    code = "FAILED_PRECONDITION"


class Unavailable(RegistryError):
    """The database cannot be reached; the client may retry with the same request id."""

    code = "UNAVAILABLE"
