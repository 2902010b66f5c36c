"""The `loadplan` console script.

Subcommands are a table of lazily imported modules, so `loadplan backends`
never imports torch and `loadplan generate` works only where the engine is
installed. A command module provides `add_arguments(parser)` and
`run(args) -> int` (the attribute names can be set per entry).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Sequence

from .errors import EXIT_BAD_INPUT, EXIT_FAILURE, CliError, exit_code_of, one_line


@dataclass(frozen=True)
class Command:
    module: str
    help: str
    add_arguments: str = "add_arguments"
    run: str = "run"
    extra: str | None = None      # the optional dependency set it needs, for the error message


COMMANDS: dict[str, Command] = {
    "serve": Command("loadplan.cli.serve", "run the registry gRPC server", extra="service"),
    "migrate": Command("loadplan.cli.migrate", "create or upgrade the history database", extra="service"),
    "prune": Command("loadplan.cli.prune", "delete plans older than a cutoff from the history database",
                     extra="service"),
    "resolve": Command("loadplan.cli.resolve", "resolve the load plan of one runner from DIR/config.json"),
    "plans": Command("loadplan.cli.plans", "list, show and diff recorded plans"),
    "backends": Command("loadplan.cli.backends", "an engine's a2a backends, as that engine spells them"),
    "capabilities": Command("loadplan.cli.capabilities",
                            "which a2a backends and MoE runners the engine would start one runner with"),
    "engines": Command("loadplan.cli.engines", "the engines and releases whose decisions the registry makes"),
    "upgrade-check": Command("loadplan.cli.upgrade_check",
                             "re-decide every stored deployment under another engine release"),
    "coverage": Command("loadplan.cli.coverage", "check that every entry class reaches a fusion gate"),
    "sglang-run": Command("loadplan.integrations.sglang_run",
                          "run an SGLang command whose every runner asks the registry for its load plan"),
    "generate": Command("loadplan.cli.generate", "greedy generation with a MoE checkpoint",
                        add_arguments="add_generate_arguments", run="run_generate", extra="engine"),
    "demo": Command("loadplan.cli.demo", "make tiny checkpoints and run the whole path on them",
                    add_arguments="add_demo_arguments", run="run_demo", extra="engine"),
}


class _Parser(argparse.ArgumentParser):
    """Usage errors become the CLI's one-line error instead of argparse's usage dump."""

    def error(self, message: str):
        raise CliError("INVALID_ARGUMENT", f"{self.prog}: {message} (see `{self.prog} --help`)", EXIT_BAD_INPUT)


def _top_parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name.ljust(width)}  {cmd.help}" for name, cmd in COMMANDS.items())
    parser = _Parser(prog="loadplan", usage="loadplan [-h] [--version] COMMAND [ARGS...]", description="Load-time decisions for MoE inference workers.",
                     epilog=f"commands:\n{listing}\n\nRun `loadplan COMMAND --help` for a command's options.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"loadplan {_version()}")
    parser.add_argument("command", metavar="COMMAND", choices=list(COMMANDS), help=argparse.SUPPRESS)
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _version() -> str:
    from .. import __version__

    return __version__


def _load(name: str, cmd: Command):
    try:
        module = importlib.import_module(cmd.module)
    except ImportError as e:
        need = f" (pip install 'loadplan[{cmd.extra}]')" if cmd.extra else ""
        raise CliError("FAILED_PRECONDITION", f"the '{name}' command is not available: {cmd.module} cannot be "
                       f"imported ({one_line(e)}){need}", EXIT_FAILURE) from None
    try:
        return getattr(module, cmd.add_arguments), getattr(module, cmd.run)
    except AttributeError as e:
        raise CliError("FAILED_PRECONDITION", f"the '{name}' command is not available: {one_line(e)}",
                       EXIT_FAILURE) from None


def dispatch(argv: Sequence[str]) -> int:
    top = _top_parser()
    if not argv:
        top.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    ns = top.parse_args(list(argv))
    add_arguments, run = _load(ns.command, COMMANDS[ns.command])
    parser = _Parser(prog=f"loadplan {ns.command}", description=COMMANDS[ns.command].help)
    add_arguments(parser)
    return int(run(parser.parse_args(ns.args)) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return dispatch(argv)
    except CliError as e:
        print(f"error: {e.code}: {one_line(e.message)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: CANCELLED: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`loadplan plans list | head`): not an error worth a traceback.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    except Exception as e:  # noqa: BLE001 - the client's errors, without importing grpc up front
        from loadplan.client import RegistryCallError

        if not isinstance(e, RegistryCallError):
            raise
        print(f"error: {e.code}: {one_line(e.message)}", file=sys.stderr)
        return exit_code_of(e.code)


if __name__ == "__main__":
    sys.exit(main())
