"""Typed, path-aware reads of a checkpoint's config.json.

Every read names the field on failure ("config.text_config.n_routed_experts:
missing"), so a bad config is an INVALID_ARGUMENT that says what to fix.
"""

from __future__ import annotations

from typing import Any, Mapping

from .errors import InvalidArgument

_MISSING = object()
# A wrong value is quoted in the error, cut to this length: a 3 MiB string in the wrong
# field must not become a 3 MiB status message (gRPC refuses trailers over 16 KiB).
QUOTE_LEN = 80


def quote(value: Any) -> str:
    """repr(value), cut to QUOTE_LEN characters."""
    text = repr(value)
    return text if len(text) <= QUOTE_LEN else f"{text[:QUOTE_LEN]}... ({len(text)} characters)"


class ConfigView:
    def __init__(self, data: Mapping[str, Any], path: str = "config"):
        if not isinstance(data, Mapping):
            raise InvalidArgument(path, f"must be a JSON object, got {type(data).__name__}")
        self.data = data
        self.path = path

    def field(self, name: str) -> str:
        return f"{self.path}.{name}"

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str, default: Any = None) -> Any:
        return self.data.get(name, default)

    def int(self, name: str, default: Any = _MISSING, *, minimum: int | None = None,
            maximum: int | None = None) -> int:
        value = self.data.get(name)
        if value is None:
            if default is _MISSING:
                raise InvalidArgument(self.field(name), "missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(self.field(name), f"must be an integer, got {quote(value)}")
        if minimum is not None and value < minimum:
            raise InvalidArgument(self.field(name), f"must be >= {minimum}, got {quote(value)}")
        if maximum is not None and value > maximum:
            raise InvalidArgument(self.field(name), f"must be <= {maximum}, got {quote(value)}")
        return value

    def int_list(self, name: str, default: list[int] | None = None) -> list[int]:
        value = self.data.get(name)
        if value is None:
            return list(default or [])
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise InvalidArgument(self.field(name), f"must be a list of integers, got {quote(value)}")
        return list(value)

    def sub(self, name: str, why: str = "") -> "ConfigView":
        value = self.data.get(name)
        if value is None:
            raise InvalidArgument(self.field(name), "missing" + (f" ({why})" if why else ""))
        return ConfigView(value, self.field(name))

    def architecture(self) -> str:
        archs = self.data.get("architectures")
        if archs is None:
            raise InvalidArgument(self.field("architectures"), "missing")
        if not isinstance(archs, list) or not archs or not all(isinstance(a, str) and a for a in archs):
            raise InvalidArgument(self.field("architectures"), f"must be a non-empty list of names, got {quote(archs)}")
        return archs[0]
