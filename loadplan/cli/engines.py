"""`loadplan engines`: the engines the registry answers for, each one profile of the rules."""

from __future__ import annotations

import argparse
import dataclasses

from .output import print_json, table

HELP = "the engines and releases whose decisions the registry makes (runtime.engine, runtime.engine_version)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--inputs", action="store_true",
                        help="the engine's own arguments and switches each profile reads (--engine-arg, --engine-env)")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from loadplan.service.rules.engines import ENGINES   # pure Python: no grpc, no database

    if args.inputs:
        return _inputs(args)

    rows = [(e, release) for e in ENGINES.values() for release in e.releases]
    if args.json:
        print_json([{**dataclasses.asdict(e), "version": e.version, "release": release, "status": e.status(release),
                     "profile": e.profile(release)} for e, release in rows])
        return 0
    print(table(("ENGINE", "RELEASE", "STATUS", "DEFAULT ON", "MOE RUNNER BACKEND", "CHECKED BY", "WHAT DECIDES"),
                ((e.name, release, e.status(release), ", ".join(e.default_for) or "-",
                  "yes" if e.reads_moe_runner_backend else "-", e.checked_by, e.summary) for e, release in rows)))
    return 0


def _inputs(args: argparse.Namespace) -> int:
    from loadplan.engine_inputs import READS

    rows = [(engine, r) for engine, inputs in READS.items() for r in inputs]
    if args.json:
        print_json([{"engine": engine, "kind": r.kind, "name": r.name, "default": r.default, "where": r.where,
                     "same_as": r.same_as} for engine, r in rows])
        return 0
    print(table(("ENGINE", "KIND", "NAME", "DEFAULT", "MEANS THE SAME AS", "WHERE THE ENGINE READS IT"),
                ((engine, "--engine-" + r.kind, r.name, r.default, r.same_as or "-", r.where) for engine, r in rows)))
    return 0
