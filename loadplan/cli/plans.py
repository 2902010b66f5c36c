"""`loadplan plans list|show|diff`: the audit side of the history."""

from __future__ import annotations

import argparse

from .options import add_registry_arguments, iso_time, open_client, positive_int
from .output import (decision_json, decisions_table, history_table, iso, plan_header, plan_json, print_json,
                     ranks, table, value_text)

HELP = "list, show and diff recorded plans"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = sub.add_parser("list", help="plans, newest first")
    ls.add_argument("--deployment", metavar="ID")
    ls.add_argument("--role", choices=("target", "speculative"))
    ls.add_argument("--entry-class", metavar="NAME")
    ls.add_argument("--host")
    ls.add_argument("--since", type=iso_time("--since"), metavar="TIME", help="ISO 8601, inclusive (naive is UTC)")
    ls.add_argument("--until", type=iso_time("--until"), metavar="TIME", help="ISO 8601, exclusive (naive is UTC)")
    ls.add_argument("--limit", type=positive_int("--limit"), default=50, metavar="N",
                    help="at most N plans (default 50)")
    show = sub.add_parser("show", help="one plan and its decisions")
    show.add_argument("plan_id", metavar="PLAN_ID")
    show.add_argument("--history", action="store_true", help="every revision of every decision")
    diff = sub.add_parser("diff", help="decisions and inputs that differ between two plans")
    diff.add_argument("plan_a", metavar="A")
    diff.add_argument("plan_b", metavar="B")
    for p in (ls, show, diff):
        add_registry_arguments(p)
        p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    return {"list": _list, "show": _show, "diff": _diff}[args.action](args)


def _list(args) -> int:
    plans = []
    with open_client(args) as client:
        for plan in client.iter_plans(deployment_id=args.deployment, role=args.role, entry_class=args.entry_class,
                                      host=args.host, created_after=args.since, created_before=args.until,
                                      page_size=min(args.limit, 500)):
            plans.append(plan)
            if len(plans) >= args.limit:
                break
    if args.json:
        print_json([plan_json(p) for p in plans])
    else:
        print(table(("PLAN", "CREATED", "DEPLOYMENT", "ROLE", "RANKS", "ENTRY CLASS", "HOST"),
                    ((p.plan_id, iso(p.created_at), p.request.deployment_id, p.request.role, ranks(p),
                      p.entry_class, p.request.host) for p in plans)))
    return 0


def _show(args) -> int:
    with open_client(args) as client:
        plan = client.get_plan(args.plan_id, include_history=args.history)
    if args.json:
        print_json(plan_json(plan, history=args.history))
        return 0
    print(plan_header(plan))
    print()
    print(decisions_table(plan))
    if args.history:
        print()
        print(history_table(plan))
    return 0


def _diff(args) -> int:
    with open_client(args) as client:
        diff = client.diff_plans(args.plan_a, args.plan_b)
    if args.json:
        print_json({
            "a": diff.a.plan_id, "b": diff.b.plan_id,
            "decisions": [{"key": k, "a": decision_json(a), "b": decision_json(b)} for k, a, b in diff.decisions],
            "inputs": [{"field": f, "a": a, "b": b} for f, a, b in diff.inputs],
        })
        return 0
    print(f"A {diff.a.plan_id}  ({diff.a.request.deployment_id} {diff.a.request.role} {ranks(diff.a)})")
    print(f"B {diff.b.plan_id}  ({diff.b.request.deployment_id} {diff.b.request.role} {ranks(diff.b)})")
    print()
    if diff.decisions:
        print(table(("KEY", "A", "B", "RULE A", "RULE B"),
                    ((k, value_text(a.value) if a else "-", value_text(b.value) if b else "-",
                      a.rule if a else "-", b.rule if b else "-") for k, a, b in diff.decisions)))
    else:
        print("no decision differs")
    print()
    if diff.inputs:
        print(table(("INPUT", "A", "B"), ((f, value_text(a), value_text(b)) for f, a, b in diff.inputs)))
    else:
        print("no input differs")
    return 0
