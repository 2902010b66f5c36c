"""`loadplan backends [--engine NAME] [--engine-version V]`: an engine's a2a backends, as that engine spells them."""

from __future__ import annotations

import argparse
import dataclasses

from .options import add_registry_arguments, open_client
from .output import print_json, table

HELP = "the a2a backends of an engine and release (default: loadplan's own table)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_registry_arguments(parser)
    parser.add_argument("--engine", default="", metavar="NAME", help="loadplan (default), sglang or vllm")
    parser.add_argument("--engine-version", default="", metavar="V", help="the engine's release; default: its newest")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        rows = client.list_backends(args.engine, args.engine_version)
    if args.json:
        print_json([dataclasses.asdict(r) for r in rows])
        return 0
    yes = {True: "yes", False: "no"}
    if rows:
        print(f"{rows[0].engine} {rows[0].engine_version}")
    print(table(("BACKEND", "PATH", "COMBINE REDUCES", "DEEPEP-CLASS", "PER-RANK FUSED SLOTS", "FUSION FORCED OFF",
                 "ACCEPTED", "NOTE"),
                ((r.name, r.forward_path, yes[r.combine_reduces], yes[r.deepep_class], yes[r.per_rank_fused_slots],
                  yes[r.fusion_force_disabled], yes[r.accepted], r.note) for r in rows)))
    return 0
