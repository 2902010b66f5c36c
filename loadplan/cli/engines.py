"""`loadplan engines`: the engines the registry answers for, each one profile of the rules."""

from __future__ import annotations

import argparse
import dataclasses

from .output import print_json, table

HELP = "the engines whose decisions the registry makes (runtime.engine)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from loadplan.service.rules.engines import ENGINES   # pure Python: no grpc, no database

    rows = list(ENGINES.values())
    if args.json:
        print_json([{**dataclasses.asdict(e), "profile": e.profile} for e in rows])
        return 0
    print(table(("ENGINE", "VERSION", "DEFAULT ON", "MOE RUNNER BACKEND", "WHAT DECIDES"),
                ((e.name, e.version, ", ".join(e.default_for) or "-", "yes" if e.reads_moe_runner_backend else "-",
                  e.summary) for e in rows)))
    return 0
