"""`loadplan sglang-run [--registry ADDR] [--deployment ID] [--token ...] -- COMMAND...`

Runs COMMAND (e.g. `python -m sglang.launch_server --model-path ...`) so that every Python
process it starts, SGLang's schedulers included, installs loadplan's SGLang adapter at
start-up: LOADPLAN_SGLANG=1 and the adapter's options in the environment, and the
directory of the start-up hook (`sglang_boot/sitecustomize.py`) first on PYTHONPATH.
The command's exit status is this command's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from ..cli.errors import EXIT_BAD_INPUT, CliError
from . import sglang as adapter

BOOT_DIR = Path(__file__).resolve().parent / "sglang_boot"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--registry", default=os.environ.get(adapter.ENV_REGISTRY),
                        help=f"registry address host:port (default ${adapter.ENV_REGISTRY})")
    parser.add_argument("--deployment", default=os.environ.get(adapter.ENV_DEPLOYMENT),
                        help="deployment id of every runner the command starts "
                             "(default: sglang-<served model name>)")
    parser.add_argument("--token", default=None,
                        help="bearer token for the registry (default $LOADPLAN_TOKEN / $LOADPLAN_TOKEN_FILE)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a runner waits for its plan, retries included (default 30)")
    parser.add_argument("--allow-fallback", action="store_true",
                        help="if the registry cannot be reached, let SGLang decide itself (logged loudly) "
                             "instead of stopping the start")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")


def environment(args: argparse.Namespace, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment COMMAND runs in."""
    env = dict(os.environ if base is None else base)
    env[adapter.ENV_ACTIVE] = "1"
    env[adapter.ENV_REGISTRY] = args.registry
    if args.deployment:
        env[adapter.ENV_DEPLOYMENT] = args.deployment
    if args.token:
        env["LOADPLAN_TOKEN"] = args.token
    if args.timeout is not None:
        env[adapter.ENV_TIMEOUT] = str(args.timeout)
    if args.allow_fallback:
        env[adapter.ENV_ALLOW_FALLBACK] = "1"
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(BOOT_DIR) + (os.pathsep + path if path else "")
    return env


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("INVALID_ARGUMENT", "command: nothing to run (loadplan sglang-run [OPTIONS] -- COMMAND...)",
                       EXIT_BAD_INPUT)
    if not args.registry:
        raise CliError("INVALID_ARGUMENT", f"--registry: an address is needed (or ${adapter.ENV_REGISTRY})",
                       EXIT_BAD_INPUT)
    try:
        return subprocess.call(command, env=environment(args))
    except FileNotFoundError:
        raise CliError("INVALID_ARGUMENT", f"command: {command[0]!r} not found", EXIT_BAD_INPUT) from None
