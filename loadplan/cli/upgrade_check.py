"""`loadplan upgrade-check`: which stored deployments another engine release would plan otherwise, or refuse.

Exit status 0 when no deployment would be refused or hit a hazard under the target release, 1 otherwise.
"""

from __future__ import annotations

import argparse

from .options import add_registry_arguments, open_client
from .output import decision_json, print_json, table, value_text

HELP = "re-decide every stored deployment under another engine release: what changes, what is refused"
EXIT_BLOCKED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", required=True, help="the engine (sglang, vllm)")
    parser.add_argument("--to", required=True, metavar="RELEASE", help="the release to upgrade to")
    parser.add_argument("--from", dest="from_version", default="", metavar="RELEASE",
                        help="only deployments decided by this release (default: every other one)")
    parser.add_argument("--deployment", metavar="ID", help="only this deployment")
    add_registry_arguments(parser)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        report = client.upgrade_check(args.engine, args.to, args.from_version, args.deployment)
    if args.json:
        print_json(report_json(report))
    else:
        print(report_text(report))
    return EXIT_BLOCKED if report.blocked else 0


def report_json(report) -> dict:
    return {
        "engine": report.engine, "to_version": report.to_version, "from_version": report.from_version,
        "blocked": report.blocked,
        "deployments": [{
            "deployment_id": d.deployment_id, "from_versions": list(d.from_versions), "status": d.status,
            "roles": [{
                "role": r.role, "runners": r.runners, "status": r.status, "refusal": r.refusal,
                "refused_runners": r.refused_runners, "hazard": r.hazard,
                "changes": [{"key": c.key, "runners": c.runners,
                             "before": decision_json(c.before) if c.before is not None else None,
                             "after": decision_json(c.after) if c.after is not None else None}
                            for c in r.changes],
            } for r in d.roles],
        } for d in report.deployments],
    }


def report_text(report) -> str:
    head = (f"{report.engine} -> {report.to_version}"
            + (f" (deployments on {report.from_version})" if report.from_version else "")
            + f": {len(report.deployments)} deployment(s)"
            + (", BLOCKED: some would be refused" if report.blocked else ""))
    lines = [head, table(("DEPLOYMENT", "FROM", "ROLE", "RUNNERS", "STATUS", "WHAT"),
                         ((d.deployment_id, ", ".join(d.from_versions), r.role, r.runners, r.status,
                           r.refusal or f"{len(r.changes)} decision(s) change")
                          for d in report.deployments for r in d.roles))]
    for d in report.deployments:
        for r in d.roles:
            for c in r.changes:
                lines.append(f"\n{d.deployment_id} {r.role}: {c.key} ({c.runners} runner(s))")
                for side, dec in (("before", c.before), ("after", c.after)):
                    lines.append(f"  {side:6s} " + ("(absent)" if dec is None else
                                                    f"{value_text(dec.value)}  [{dec.rule}] {dec.reason}"))
    return "\n".join(lines)
