"""Bounded memos for what the registry encodes again and again on its one event-loop thread.

A fleet repeats few distinct values (configs, runtimes, a deployment's decisions), so each
memo is a plain dict emptied when full: simpler than an LRU and as bounded, and a miss only
costs the encoding it would have cost anyway.

- `Memo`: by value, for keys that hash cheaply (strings cache their hash; small tuples).
- `ByIdentity`: by the object's identity, for objects nobody changes that the registry shares
  between plans (frozen dataclasses, the rules cache's read-only views), where hashing or
  comparing them would cost about what encoding them does. Each entry holds its object, so
  its id cannot be reused by another object while it is remembered.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Generic, Mapping, TypeVar

V = TypeVar("V")


def is_shared_view(mapping: Mapping[Any, Any]) -> bool:
    """A read-only view the rules cache hands out (`Resolution.decisions`, `deployment_inputs`):
    the same object for every rank of a deployment, and nobody changes what it shows, so what is
    encoded from it may be remembered by its identity (`ByIdentity`). A plain mapping may change
    between plans and is encoded every time."""
    return mapping.__class__ is MappingProxyType


class Memo(Generic[V]):
    def __init__(self, compute: Callable[[Any], V], maxsize: int = 4096):
        self.compute = compute
        self.maxsize = maxsize
        self.memo: dict[Any, V] = {}

    def __call__(self, key: Any) -> V:
        value = self.memo.get(key)
        if value is None:
            value = self.compute(key)
            if len(self.memo) >= self.maxsize:
                self.memo.clear()
            self.memo[key] = value
        return value


class ByIdentity(Generic[V]):
    def __init__(self, compute: Callable[[Any], V], maxsize: int = 4096):
        self.compute = compute
        self.maxsize = maxsize
        self.memo: dict[int, tuple[Any, V]] = {}

    def __call__(self, obj: Any) -> V:
        hit = self.memo.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        value = self.compute(obj)
        if len(self.memo) >= self.maxsize:
            self.memo.clear()
        self.memo[id(obj)] = (obj, value)
        return value
