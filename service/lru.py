"""`LruCache`: a bounded, thread-safe LRU map, by key or by an object's identity.

The registry keeps what a fleet's ranks share, made once: the rules' deployment part
(rules/resolve.py), a config text's parsed object (transport/convert.py), the encodings
of a stage's shared parts in the answer (transport/convert.py) and in the row
(store/repository.py). By identity (`of`): every rank of a deployment is handed the
same read-only objects, so what encodes them can do it once per object.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable, TypeVar

T = TypeVar("T")


class LruCache:
    """At most `maxsize` entries; the least recently used one goes first. The server's event
    loop, its worker threads and in-process callers may share one."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> Any:
        """The value of `key` (now the most recently used), or None."""
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
                self._data.move_to_end(key)
            return value

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def of(self, objs: tuple, make: Callable[[], T], *values: Hashable) -> T:
        """`make()`, made once while cached for these objects (by identity: for objects that are
        not hashable, or whose equality costs more than remaking) and `values` (by equality).
        The entry holds the objects, so their ids cannot be reused while it lives. They must
        not change once made: the rules hand out read-only views, and the transport's parsed
        configs are read by nobody who writes."""
        key = (*map(id, objs), *values)
        entry = self.get(key)
        if entry is not None and all(a is b for a, b in zip(entry[0], objs)):
            return entry[1]
        value = make()
        self.put(key, (objs, value))
        return value

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
