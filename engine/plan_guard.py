"""The plan as the engine sees it: readable while building, refused during forward.

DESIGN 2: layers read the plan while being built and keep what they need as plain
attributes; nothing reads decision state during forward. `GuardedPlan` enforces
that: `plan.decisions[KEY].value` and `plan.value(KEY)` work until a forward starts
(`with plan.forward_running(): ...`, which the models' forward enters) and raise
`PlanReadDuringForward` inside it. Everything else of the LoadPlan (plan_id,
request, entry_class, ...) stays readable: it is not decision state.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Mapping

from loadplan.plan import Decision, LoadPlan


class PlanReadDuringForward(RuntimeError):
    """A decision was read while a forward was running: bake it into an attribute at build time."""


class _GuardedDecisions(Mapping[str, Decision]):
    def __init__(self, guard: "GuardedPlan"):
        self._guard = guard

    def __getitem__(self, key: str) -> Decision:
        self._guard._check(key)
        try:
            return self._guard.plan.decisions[key]
        except KeyError:
            known = ", ".join(sorted(self._guard.plan.decisions))
            raise KeyError(f"decision {key!r} not in plan {self._guard.plan.plan_id}; it has: {known}") from None

    def __iter__(self) -> Iterator[str]:
        self._guard._check("<iterate>")
        return iter(self._guard.plan.decisions)

    def __len__(self) -> int:
        return len(self._guard.plan.decisions)


class GuardedPlan:
    def __init__(self, plan: LoadPlan):
        self.plan = plan
        self._running = 0
        self._lock = threading.Lock()
        self.decisions: Mapping[str, Decision] = _GuardedDecisions(self)

    def value(self, key: str) -> Any:
        return self.decisions[key].value

    @property
    def in_forward(self) -> bool:
        return self._running > 0

    @contextlib.contextmanager
    def forward_running(self) -> Iterator[None]:
        with self._lock:
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1

    def _check(self, key: str) -> None:
        if self._running:
            raise PlanReadDuringForward(
                f"decision {key!r} read during forward (plan {self.plan.plan_id}): layers must keep what they "
                f"need as attributes at build time")

    def __getattr__(self, name: str) -> Any:
        # plan_id, request, entry_class, ruleset_version, to_json, ...: not decision state.
        if name.startswith("_") or name == "plan":
            raise AttributeError(name)
        return getattr(self.plan, name)

    def __repr__(self) -> str:
        return f"GuardedPlan({self.plan.plan_id}, {self.plan.entry_class}, in_forward={self.in_forward})"
