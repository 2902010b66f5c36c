"""`loadplan resolve`: the plan of one runner, from a checkpoint directory's config.json."""

from __future__ import annotations

import argparse

from .options import add_registry_arguments, add_runner_arguments, open_client, read_config, request_from_args
from .output import decisions_table, plan_header, print_json

HELP = "resolve the load plan of one runner from DIR/config.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory holding config.json")
    add_registry_arguments(parser)
    add_runner_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    request = request_from_args(args, read_config(args.model))
    with open_client(args) as client:
        plan = client.resolve_load_plan(request)
    if args.json:
        print_json(plan.to_json())
    else:
        print(plan_header(plan))
        print()
        print(decisions_table(plan))
    return 0
