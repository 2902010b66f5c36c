"""`loadplan coverage`: does every entry class reach a fusion gate?

The entry classes come from the first source that imports: the engine's table
(every class the engine can build) and otherwise the registry's own table (an
empty question, which the registry answers about itself). Exit 1 if any is not ok.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys

from .errors import EXIT_FAILURE, one_line
from .options import add_registry_arguments, open_client
from .output import print_json, table

HELP = "check that every entry class the engine builds reaches a fusion gate"

# (label, module, attribute): a dict or list of entry class names. Tried in order.
SOURCES = [("engine", "loadplan.engine.registry", "ENGINE_ENTRY_CLASSES")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_registry_arguments(parser)
    parser.add_argument("--json", action="store_true")


def entry_classes() -> tuple[str, list[str]]:
    """(source label, names); ("registry", []) when no source can be imported."""
    for label, module, attr in SOURCES:
        try:
            table_ = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            print(f"note: {label} entry classes unavailable ({one_line(e)}); checking the registry's own "
                  f"entry classes", file=sys.stderr)
            continue
        return label, list(table_)
    return "registry", []


def run(args: argparse.Namespace) -> int:
    source, names = entry_classes()
    with open_client(args) as client:
        report = client.check_coverage(names)
    if args.json:
        print_json({"source": source, "ok": report.ok, "entries": [dataclasses.asdict(e) for e in report.entries]})
    else:
        print(f"entry classes of the {source}:")
        print(table(("ENTRY CLASS", "OK", "FAMILY", "GATED", "CHAIN", "MESSAGE"),
                    ((e.entry_class, "ok" if e.ok else "FAIL", e.family or "-", "yes" if e.gated_family else "no",
                      " -> ".join(e.chain), e.message) for e in report.entries)))
    return 0 if report.ok else EXIT_FAILURE
