"""Reading config.json (a dict) with errors that name the field (`config.<name>: ...`)."""

from __future__ import annotations


class ConfigError(ValueError):
    pass


_MISSING = object()


def get_field(d: dict, name: str, default=_MISSING, kind=None):
    """d[name]; `default` when absent or null (no default: ConfigError); `kind` checks the type
    (a bool is not accepted as an int)."""
    v = d.get(name)
    if v is None:
        if default is _MISSING:
            raise ConfigError(f"config.{name}: missing")
        return default
    if kind is not None and (not isinstance(v, kind) or (kind is not bool and isinstance(v, bool))):
        raise ConfigError(f"config.{name}: expected {getattr(kind, '__name__', kind)}, got {v!r}")
    return v
