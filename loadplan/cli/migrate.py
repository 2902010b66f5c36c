"""`loadplan migrate`: upgrade the history database to the head revision."""

from __future__ import annotations

import argparse

from .errors import CliError, one_line
from .options import add_db_argument, default_db_url, redact, short_error

HELP = "create or upgrade the history database"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_db_argument(parser)


def run(args: argparse.Namespace) -> int:
    from loadplan.service.store.db import migrate

    url = args.db or default_db_url()
    try:
        migrate(url)
    except ValueError as e:
        raise CliError("INVALID_ARGUMENT", f"--db: {one_line(e)}") from None
    except Exception as e:  # noqa: BLE001
        raise CliError("UNAVAILABLE", f"database {redact(url)}: {short_error(e)}") from None
    print(f"database {redact(url)} is at head")
    return 0
