"""`loadplan serve`: run the registry on a database until SIGINT/SIGTERM, then drain."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from .errors import CliError, one_line
from .options import add_db_argument, default_db_url, redact, short_error

HELP = "run the registry gRPC server"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_db_argument(parser)
    parser.add_argument("--listen", default="127.0.0.1:50051", metavar="HOST:PORT")
    parser.add_argument("--migrate", action="store_true", help="upgrade the database to head before serving")
    parser.add_argument("--max-message-bytes", type=int, default=4 * 1024 * 1024, metavar="N",
                        help="largest request accepted (default 4 MiB)")
    parser.add_argument("--workers", type=int, default=16, metavar="N", help="RPC worker threads")


def run(args: argparse.Namespace) -> int:
    from ..service.server import RegistryServer, ServerOptions, ServerStartError
    from ..service.store.db import make_engine, migrate
    from ..service.store.repository import SqlPlanStore

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url = args.db or default_db_url()
    try:
        if args.migrate:
            migrate(url)
        engine = make_engine(url)
    except ValueError as e:
        raise CliError("INVALID_ARGUMENT", f"--db: {one_line(e)}") from None
    except Exception as e:  # noqa: BLE001
        raise CliError("UNAVAILABLE", f"database {redact(url)}: {short_error(e)}") from None
    try:
        server = RegistryServer(SqlPlanStore(engine), ServerOptions(
            listen=args.listen, max_receive_message_bytes=args.max_message_bytes, max_workers=args.workers))
    except ServerStartError as e:
        raise CliError("FAILED_PRECONDITION", one_line(e)) from None
    server.start()
    print(f"loadplan registry listening on {server.address} (database {redact(url)})", flush=True)
    if not server.serving:
        print(f"warning: database {redact(url)} is not reachable or not migrated; health is NOT_SERVING until it "
              f"is (run `loadplan migrate --db URL`)", file=sys.stderr, flush=True)
    done = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: done.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        done.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop()
        engine.dispose()
    return 0
