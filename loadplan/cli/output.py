"""Readable tables and JSON documents of plans, shared by the commands."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Sequence

from ..plan import Decision, LoadPlan


def value_text(value: Any) -> str:
    return json.dumps(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def ranks(plan: LoadPlan) -> str:
    p = plan.request.parallel
    return f"tp {p.tp_rank}/{p.tp_size} ep {p.ep_rank}/{p.ep_size} pp {p.pp_rank}/{p.pp_size}"


def iso(when) -> str:
    return when.isoformat() if when is not None else ""


def decision_json(d: Decision | None) -> dict[str, Any] | None:
    if d is None:
        return None
    return {"value": d.value, "reason": d.reason, "rule": d.rule}


def plan_json(plan: LoadPlan, *, history: bool = False) -> dict[str, Any]:
    """`LoadPlan.to_json()` plus what an audit wants to see of the runner."""
    req = plan.request
    doc = plan.to_json()
    doc.update({
        "request_id": req.request_id,
        "created_at": iso(plan.created_at),
        "host": req.host,
        "parallel": dataclasses.asdict(req.parallel),
        "runtime": {**dataclasses.asdict(req.runtime), "engine_args": dict(req.runtime.engine_args),
                    "engine_env": dict(req.runtime.engine_env)},
        "config_fingerprint": plan.config_fingerprint,
        "quantization": plan.quantization,
        "observed": plan.observed,
    })
    if history:
        doc["history"] = [{"key": d.key, "revision": d.revision, "decided_at": iso(d.decided_at),
                           **decision_json(d)} for d in plan.history]
    return doc


def plan_header(plan: LoadPlan) -> str:
    req = plan.request
    return (f"plan {plan.plan_id}{' (replayed)' if plan.replayed else ''}\n"
            f"  deployment {req.deployment_id}  role {req.role}  {ranks(plan)}  host {req.host or '-'}\n"
            f"  entry class {plan.entry_class}  quantization {plan.quantization or '-'}  "
            f"ruleset {plan.ruleset_version}  created {iso(plan.created_at) or '-'}\n"
            f"  engine {req.runtime.engine or '-'} {req.runtime.engine_version}"
            f"{' (OBSERVED: no profile of this release; the engine decided)' if plan.observed else ''}  "
            f"device {req.runtime.device}  a2a backend {req.runtime.a2a_backend}"
            + "".join(f"\n  engine {kind} " + " ".join(f"{k}={v}" for k, v in pairs)
                      for kind, pairs in (("args", req.runtime.engine_args), ("env", req.runtime.engine_env)) if pairs))


def decisions_table(plan: LoadPlan) -> str:
    return table(("KEY", "VALUE", "RULE", "REASON"),
                 ((d.key, value_text(d.value), d.rule, d.reason) for _, d in sorted(plan.decisions.items())))


def history_table(plan: LoadPlan) -> str:
    return table(("KEY", "REV", "VALUE", "RULE", "DECIDED AT", "REASON"),
                 ((d.key, d.revision, value_text(d.value), d.rule, iso(d.decided_at), d.reason)
                  for d in plan.history))


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False))
