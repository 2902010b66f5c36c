"""`loadplan serve`: run the registry on a database until SIGINT/SIGTERM, then drain.

Security (service/auth.py, service/tls.py): `--tokens-file FILE` (or
$LOADPLAN_TOKENS_FILE, plus entries in $LOADPLAN_TOKENS) turns bearer-token
authentication on; `--tls-cert` + `--tls-key` serve TLS, and `--tls-client-ca`
makes it mutual TLS (clients need a certificate that CA signed).

The embedded default just works: on a SQLite file `serve` creates or upgrades
its schema itself (one process owns the file). PostgreSQL is shared by replicas
whose upgrade is an operator's step: `loadplan migrate` (the compose `migrate`
job) or `serve --migrate`.

`--http HOST:PORT` (off unless given) also serves Prometheus metrics at
`/metrics` and a read-only web view of the history (service/http/), with the
gRPC port's TLS and the reader role's token when tokens are on.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading

from .errors import CliError, one_line
from .options import add_db_argument, default_db_url, positive_int, redact, short_error

HELP = "run the registry gRPC server"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_db_argument(parser)
    parser.add_argument("--listen", default="127.0.0.1:50051", metavar="HOST:PORT")
    parser.add_argument("--migrate", action="store_true",
                        help="upgrade the database to head before serving (a SQLite file is always upgraded)")
    parser.add_argument("--http", default=None, metavar="HOST:PORT",
                        help="also serve /metrics (Prometheus) and the read-only web view of the history here "
                             "(off unless given)")
    parser.add_argument("--max-message-bytes", type=positive_int("--max-message-bytes"), default=4 * 1024 * 1024,
                        metavar="N", help="largest request accepted (default 4 MiB)")
    parser.add_argument("--workers", type=positive_int("--workers"), default=None, metavar="N",
                        help="worker threads for the database calls that block (default 64: reads, group commits)")
    parser.add_argument("--max-pending-calls", type=positive_int("--max-pending-calls"), default=None, metavar="N",
                        help="calls gRPC holds for the server before it refuses more (the client sees CANCELLED): "
                             "at least the ranks that may reach one replica at once (default 8192)")
    sec = parser.add_argument_group("security")
    sec.add_argument("--tokens-file", metavar="FILE", default=None,
                     help="ROLE:TOKEN lines (roles worker, reader, admin); default $LOADPLAN_TOKENS_FILE, plus "
                          "entries in $LOADPLAN_TOKENS; none at all: the registry is open")
    sec.add_argument("--tls-cert", metavar="FILE", default=None, help="server certificate (PEM); with --tls-key: TLS")
    sec.add_argument("--tls-key", metavar="FILE", default=None, help="its private key (PEM)")
    sec.add_argument("--tls-client-ca", metavar="FILE", default=None,
                     help="CA of client certificates: mutual TLS, clients without one are refused")


def run(args: argparse.Namespace) -> int:
    from loadplan.service.auth import TokenConfigError, load_tokens
    from loadplan.service.server import RegistryServer, ServerOptions, ServerStartError
    from loadplan.service.store.db import make_engine, migrate, normalize_url
    from loadplan.service.store.repository import SqlPlanStore
    from loadplan.service.tls import TlsConfigError, describe, server_tls

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url = args.db or default_db_url()
    try:
        tokens = load_tokens(args.tokens_file)
    except TokenConfigError as e:
        raise CliError("INVALID_ARGUMENT", one_line(e)) from None
    try:
        tls = server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
        if tls is not None:
            tls.credentials()       # read and check the files now: a bad one is the caller's error, not a bind error
    except TlsConfigError as e:
        raise CliError("INVALID_ARGUMENT", one_line(e)) from None
    try:
        if args.migrate or normalize_url(url).drivername.startswith("sqlite"):
            migrate(url)
        engine = make_engine(url)
    except ValueError as e:
        raise CliError("INVALID_ARGUMENT", f"--db: {one_line(e)}") from None
    except Exception as e:  # noqa: BLE001
        raise CliError("UNAVAILABLE", f"database {redact(url)}: {short_error(e)}") from None
    metrics = None
    if args.http:
        from loadplan.service.metrics import RegistryMetrics, ResolveMetrics
        metrics = RegistryMetrics()
    store = SqlPlanStore(engine)
    try:
        server = RegistryServer(store, ServerOptions(
            listen=args.listen, max_receive_message_bytes=args.max_message_bytes,
            **({} if args.workers is None else {"max_workers": args.workers}),
            **({} if args.max_pending_calls is None else {"max_pending_calls": args.max_pending_calls}),
            tokens=tokens, tls=tls, interceptors=(ResolveMetrics(metrics),) if metrics else (),
            on_commit=metrics.observe_commit if metrics else None))
    except ServerStartError as e:
        raise CliError("FAILED_PRECONDITION", one_line(e)) from None
    http = None
    if args.http:
        http = _http_server(server, store, metrics, args.http, tokens, tls)
    server.start()
    if http is not None:
        http.start()
    # Everything made so far (modules, tables, the rules) lives as long as the process: take it out
    # of the cyclic collector's sight. Otherwise every full collection walks it all, a 30-40 ms
    # stall of the event loop (every call in flight waits: the p99 at 64 resolves in flight was
    # these stalls, measured with gc.callbacks).
    gc.freeze()
    print(f"loadplan registry listening on {server.address} (database {redact(url)}; {describe(tls)}, "
          f"{'bearer tokens' if tokens else 'no authentication'})", flush=True)
    if http is not None:
        print(f"loadplan web view and /metrics on {http.scheme}://{http.address}/", flush=True)
    if not server.serving:
        print(f"warning: database {redact(url)} is not reachable or not migrated; health is NOT_SERVING until it "
              f"is (`serve` upgrades SQLite itself, not PostgreSQL: run `loadplan migrate --db URL` or "
              f"`serve --migrate`)", file=sys.stderr, flush=True)
    done = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: done.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        done.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if http is not None:
            http.stop()
        server.stop()
        engine.dispose()
    return 0


def _http_server(server, store, metrics, listen: str, tokens, tls):
    """`--http`: the web view and /metrics of `server` (service/http/), not started yet."""
    from loadplan.service.http.app import create_app
    from loadplan.service.http.server import HttpServer, HttpStartError
    from loadplan.service.registry import Registry

    metrics.follow(server)
    app = create_app(Registry(store), metrics, tokens or None, secure_cookie=tls is not None)
    try:
        return HttpServer(app, listen, tls)
    except HttpStartError as e:
        server.stop()
        raise CliError("FAILED_PRECONDITION", one_line(e)) from None
