"""The process's parallel context: which EP/PP/TP groups the layers being built use.

Model code never creates process groups nor names a backend. A worker that runs on
several ranks creates the grid (groups.py) and sets it here BEFORE building its
models; `RoutedExperts` picks its EP group up at construction and keeps it as an
attribute (like a plan decision, it is never looked up during forward). A single
process sets nothing: `current()` is None and a plan with ep_size > 1 can then
only run with an explicitly supplied `reduce` (tests).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass(frozen=True)
class ParallelContext:
    grid: Any                      # engine.parallel.groups.Grid of this rank

    @property
    def ep_group(self):
        return self.grid.ep_group

    @property
    def pp_group(self):
        return self.grid.pp_group

    @property
    def tp_group(self):
        return self.grid.tp_group


_current: ParallelContext | None = None


def current() -> ParallelContext | None:
    return _current


def set_parallel_context(ctx: ParallelContext | None) -> None:
    global _current
    _current = ctx


@contextlib.contextmanager
def parallel_context(ctx: ParallelContext | None) -> Iterator[ParallelContext | None]:
    """Set `ctx` for the models built inside the block; restores the previous one."""
    global _current
    old, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = old
