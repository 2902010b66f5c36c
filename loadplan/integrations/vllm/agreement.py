"""Does the plan say what vLLM is about to build? A disagreement stops the worker before it builds."""

from __future__ import annotations

from typing import Iterable

from ...plan import LoadPlan
from .built import Built


class PlanRefused(RuntimeError):
    """The registry refused this runner's plan, or the plan disagrees with what vLLM would build.
    Raised in the worker before the model is built: vLLM reports it as the worker's failure."""


def disagreements(plan: LoadPlan, built: Iterable[Built]) -> list[str]:
    """One line per decision where the plan and vLLM differ; keys the plan does not hold are not compared."""
    out = []
    for b in built:
        if b.key in plan.decisions and plan.decisions[b.key].value != b.value:
            d = plan.decisions[b.key]
            out.append(f"{b.key}: the plan says {d.value!r} ({d.reason}), vLLM builds {b.value!r} ({b.source})")
    return out


def check_agreement(plan: LoadPlan, built: Iterable[Built]) -> None:
    lines = disagreements(plan, built)
    if lines:
        raise PlanRefused(f"loadplan: plan {plan.plan_id} (deployment {plan.request.deployment_id}, role "
                          f"{plan.request.role}) disagrees with what vLLM is about to build; not building it:\n  "
                          + "\n  ".join(lines))
