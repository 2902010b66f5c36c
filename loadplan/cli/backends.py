"""`loadplan backends`: the registry's a2a backend capability table."""

from __future__ import annotations

import argparse
import dataclasses

from .options import add_registry_arguments, open_client
from .output import print_json, table

HELP = "the a2a backend capability table"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_registry_arguments(parser)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        rows = client.list_backends()
    if args.json:
        print_json([dataclasses.asdict(r) for r in rows])
        return 0
    yes = {True: "yes", False: "no"}
    print(table(("BACKEND", "PATH", "COMBINE REDUCES", "DEEPEP-CLASS", "PER-RANK FUSED SLOTS", "FUSION FORCED OFF"),
                ((r.name, r.forward_path, yes[r.combine_reduces], yes[r.deepep_class], yes[r.per_rank_fused_slots],
                  yes[r.fusion_force_disabled]) for r in rows)))
    return 0
