"""`loadplan prune`: delete old plans from the history database (service/store/retention.py).

A maintenance job on the database, like `loadplan migrate` (a cron job or a scheduled
container beside the registry), not a registry call: it needs the database's credentials,
which workers and readers do not have.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re

from .errors import CliError, one_line
from .options import add_db_argument, default_db_url, iso_time, positive_int, redact, short_error
from .output import iso, print_json

HELP = "delete plans older than a cutoff from the history database"
# A pruned plan's request id is forgotten (a retry gets a new plan): never prune what clients may still retry.
MIN_AGE = dt.timedelta(hours=1)
# A prune's statements (a count over the whole history, a batch's deletes) may take longer than a
# registry's 5 s bound on a large PostgreSQL history; still bounded, so a stalled database fails the job.
OPERATION_TIMEOUT_S = 300.0
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
_DURATION = re.compile(r"^(\d+)([smhdw])$")


def _duration(text: str) -> dt.timedelta:
    m = _DURATION.match(text.strip())
    if not m:
        raise CliError("INVALID_ARGUMENT", f"--older-than: {text!r} is not a duration (a number and one of "
                       f"{', '.join(_UNITS)}: 30d, 12h, 2w)")
    return dt.timedelta(**{_UNITS[m[2]]: int(m[1])})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_db_argument(parser)
    cutoff = parser.add_mutually_exclusive_group(required=True)
    cutoff.add_argument("--older-than", type=_duration, metavar="DURATION",
                        help="prune plans created longer ago than this: 30d, 12h, 2w (at least 1h)")
    cutoff.add_argument("--before", type=iso_time("--before", "2026-11-01T00:00:00+00:00"), metavar="TIME",
                        help="prune plans created before this ISO 8601 time (naive is UTC; at least 1h ago)")
    parser.add_argument("--dry-run", action="store_true", help="count what would be pruned, delete nothing")
    parser.add_argument("--batch-size", type=positive_int("--batch-size"), default=1000, metavar="N",
                        help="plans per transaction (default 1000)")
    parser.add_argument("--json", action="store_true")


def cutoff_of(args: argparse.Namespace, now: dt.datetime) -> dt.datetime:
    """The cutoff the arguments name, refused (by flag) if it is less than MIN_AGE before `now`."""
    flag, before = ("--older-than", now - args.older_than) if args.older_than is not None else ("--before", args.before)
    if before > now - MIN_AGE:
        raise CliError("INVALID_ARGUMENT", f"{flag}: the cutoff {iso(before)} is less than {MIN_AGE} ago; plans "
                       f"that recent may still be retried by their clients with the same request id")
    return before


def run(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from loadplan.service.store.db import make_engine
    from loadplan.service.store.retention import prune_plans

    before = cutoff_of(args, dt.datetime.now(dt.timezone.utc))
    url = args.db or default_db_url()
    try:
        engine = make_engine(url, operation_timeout_s=OPERATION_TIMEOUT_S)
    except ValueError as e:
        raise CliError("INVALID_ARGUMENT", f"--db: {one_line(e)}") from None
    try:
        report = prune_plans(engine, before, dry_run=args.dry_run, batch_size=args.batch_size)
    except SQLAlchemyError as e:
        raise CliError("UNAVAILABLE", f"database {redact(url)}: {short_error(e)} (whole batches already pruned "
                       f"stay pruned; run it again)") from None
    finally:
        engine.dispose()
    if args.json:
        print_json({"before": iso(report.before), "dry_run": report.dry_run, "older": report.older,
                    "kept_pinned": report.kept_pinned, "kept_active": report.kept_active, "pruned": report.pruned,
                    "batches": report.batches})
        return 0
    verb = "would prune" if report.dry_run else "pruned"
    print(f"{verb} {report.pruned} of the {report.older} plans created before {iso(report.before)} "
          f"(kept: {report.kept_pinned} pinned by their deployment, {report.kept_active} with decisions since)")
    return 0
