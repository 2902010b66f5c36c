"""`loadplan capabilities`: for one runner, which a2a backends and MoE runners its engine would start with."""

from __future__ import annotations

import argparse
import dataclasses

from .options import add_registry_arguments, add_runner_arguments, open_client, read_config, request_from_args
from .errors import one_line
from .output import print_json, table

HELP = "which a2a backends and MoE runners the engine would start this runner with, and why not the others"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory holding config.json")
    add_registry_arguments(parser)
    add_runner_arguments(parser)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    request = request_from_args(args, read_config(args.model))
    with open_client(args) as client:
        report = client.check_capabilities(request)
    if args.json:
        print_json(dataclasses.asdict(report))
        return 0
    print(f"{report.engine} {report.engine_version}")
    for title, rows in (("A2A BACKEND", report.backends), ("MOE RUNNER", report.moe_runners)):
        if rows:
            print(table((title, "STARTS", "PATH", "FUSED", "WHY"),
                        ((c.name, "yes" if c.starts else "no", c.forward_path or "-",
                          ("yes" if c.shared_experts_fusion else "no") if c.starts else "-", one_line(c.reason)) for c in rows)))
    return 0
