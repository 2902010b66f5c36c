"""An in-memory `PlanStore` with the SQL store's semantics, for transport, client and CLI tests.

Same contract as `loadplan.service.store.repository.SqlPlanStore`: replay by
request id (a different request under a known id is FAILED_PRECONDITION), the
(deployment, role) pin refusing a rank whose deployment-wide inputs differ,
nothing written on any error, newest-first pages, revisioned appends. One lock
makes each call atomic, like the database transaction does.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

from loadplan.plan import Decision, LoadPlan
from loadplan.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from loadplan.service.registry import NewPlan, PlanFilter
from loadplan.service.rules.resolve import diff_deployment_inputs, fingerprint


class FakePlanStore:
    def __init__(self, *, ready: bool = True):
        self._lock = threading.Lock()
        self.plans: dict[str, LoadPlan] = {}              # plan_id -> plan as saved (history empty)
        self.history: dict[str, list[Decision]] = {}      # plan_id -> every revision
        self.by_request: dict[str, tuple[str, str]] = {}  # request_id -> (request fingerprint, plan_id)
        self.pins: dict[tuple[str, str], tuple[str, dict]] = {}
        self.appends: dict[str, tuple[str, str]] = {}     # append request_id -> (plan_id, fingerprint)
        self.is_ready = ready
        self.save_calls: list[str] = []                   # request ids save_plan was called with
        self.fail_next_saves = 0                          # raise Unavailable this many times first

    # --- PlanStore -----------------------------------------------------------------

    def save_plan(self, new: NewPlan) -> LoadPlan:
        req = new.plan.request
        with self._lock:
            self.save_calls.append(req.request_id)
            if self.fail_next_saves > 0:
                self.fail_next_saves -= 1
                raise Unavailable("database unavailable while saving a plan (fake); retry with the same request id")
            if req.request_id in self.by_request:
                fp, plan_id = self.by_request[req.request_id]
                if fp != new.request_fingerprint:
                    raise FailedPrecondition(f"request_id {req.request_id!r} was used for a different request",
                                             field="request_id")
                return dataclasses.replace(self.plans[plan_id], replayed=True)
            key = (req.deployment_id, req.role)
            if key in self.pins:
                pin_plan, pinned = self.pins[key]
                differing = diff_deployment_inputs(pinned, new.deployment_inputs)
                if differing:
                    raise FailedPrecondition(
                        f"deployment {req.deployment_id!r} role {req.role!r} is pinned by plan {pin_plan} to "
                        f"different deployment-wide inputs; every rank must agree on {', '.join(differing)}",
                        field=differing[0])
            else:
                self.pins[key] = (new.plan.plan_id, dict(new.deployment_inputs))
            self.plans[new.plan.plan_id] = plan = new.plan.dated()   # as a real store reads it back
            self.history[plan.plan_id] = list(plan.decisions.values())
            self.by_request[req.request_id] = (new.request_fingerprint, plan.plan_id)
            return new.plan

    def save_batch(self, news: Sequence[NewPlan]) -> list[LoadPlan | Exception]:
        """`save_plan` of each, in order; a refusal is that plan's outcome, Unavailable the batch's."""
        out: list[LoadPlan | Exception] = []
        for new in news:
            try:
                out.append(self.save_plan(new))
            except Unavailable:
                raise
            except Exception as err:  # noqa: BLE001 - that plan's outcome
                out.append(err)
        return out

    def get_plan(self, plan_id: str, include_history: bool = False) -> LoadPlan:
        with self._lock:
            return self._get(plan_id, include_history)

    def _get(self, plan_id: str, include_history: bool) -> LoadPlan:
        if plan_id not in self.plans:
            raise NotFound("plan", plan_id, field="plan_id")
        plan = self.plans[plan_id]
        return dataclasses.replace(plan, history=tuple(self.history[plan_id]) if include_history else ())

    def list_plans(self, flt: PlanFilter, page_size: int, page_token: str | None) -> tuple[list[LoadPlan], str]:
        try:
            offset = int(page_token) if page_token else 0
        except ValueError:
            raise InvalidArgument("page_token", "malformed; pass the next_page_token of a previous answer") \
                from None
        with self._lock:
            plans = sorted(self.plans.values(), key=lambda p: (p.created_at, p.plan_id), reverse=True)
        plans = [p for p in plans if _matches(p, flt)]
        page = plans[offset:offset + page_size]
        more = offset + page_size < len(plans)
        return page, str(offset + page_size) if more else ""

    def append_decisions(self, request_id: str, plan_id: str, decisions: Sequence[Decision]) -> LoadPlan:
        fp = fingerprint([plan_id, [(d.key, d.value, d.reason, d.rule) for d in decisions]])
        with self._lock:
            if request_id in self.appends:
                if self.appends[request_id] != (plan_id, fp):
                    raise FailedPrecondition(f"request_id {request_id!r} was used for a different request",
                                             field="request_id")
                return dataclasses.replace(self._get(plan_id, False), replayed=True)
            if plan_id not in self.plans:
                raise NotFound("plan", plan_id, field="plan_id")
            plan = self.plans[plan_id]
            latest = dict(plan.decisions)
            for d in decisions:
                revision = latest[d.key].revision + 1 if d.key in latest else 0
                latest[d.key] = dataclasses.replace(d, revision=revision)
                self.history[plan_id].append(latest[d.key])
            self.plans[plan_id] = dataclasses.replace(plan, decisions=latest)
            self.appends[request_id] = (plan_id, fp)
            return self._get(plan_id, False)

    def ready(self) -> bool:
        return self.is_ready

    # --- for assertions -------------------------------------------------------------

    def count(self) -> int:
        with self._lock:
            return len(self.plans)


def _matches(p: LoadPlan, flt: PlanFilter) -> bool:
    req = p.request
    return ((flt.deployment_id is None or req.deployment_id == flt.deployment_id)
            and (flt.role is None or req.role == flt.role)
            and (flt.entry_class is None or p.entry_class == flt.entry_class)
            and (flt.host is None or req.host == flt.host)
            and (flt.created_after is None or p.created_at >= flt.created_after)
            and (flt.created_before is None or p.created_at < flt.created_before))
