"""Options several commands share: where the registry is, how to reach it securely, and what a runner asks.

`add_runner_arguments` / `request_from_args` are the flags of `loadplan resolve`;
the engine's `generate` reuses them so both speak the same runtime flags.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import pathlib
import socket
import uuid
from typing import Any, Iterator

from loadplan.client import RegistryClient
from ..plan import ROLES, Parallel, ResolveRequest, Runtime
from .errors import EXIT_FAILURE, CliError, one_line

DEFAULT_DB_URL = "sqlite:///loadplan.db"
DB_URL_ENV = "LOADPLAN_DB_URL"


def default_db_url() -> str:
    return os.environ.get(DB_URL_ENV) or DEFAULT_DB_URL


def iso_time(flag: str, example: str = "2026-11-29T10:00:00+00:00"):
    """An argparse type: an ISO 8601 time (a naive one is UTC), refused naming `flag`."""
    def parse(text: str) -> dt.datetime:
        try:
            when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise CliError("INVALID_ARGUMENT", f"{flag}: {text!r} is not an ISO 8601 time (e.g. {example})") from None
        return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)
    return parse


def positive_int(flag: str):
    """An argparse type: an integer >= 1, refused naming `flag`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise CliError("INVALID_ARGUMENT", f"{flag}: {text!r} is not an integer") from None
        if value < 1:
            raise CliError("INVALID_ARGUMENT", f"{flag}: must be >= 1, got {value}")
        return value
    return parse


def add_db_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", metavar="URL", default=None,
                        help=f"history database (default ${DB_URL_ENV} or {DEFAULT_DB_URL})")


def add_registry_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--registry", metavar="HOST:PORT", help="a running registry (default: an embedded one)")
    where.add_argument("--db", metavar="URL", default=None,
                       help=f"database of the embedded registry (default ${DB_URL_ENV} or {DEFAULT_DB_URL})")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS", help="deadline of each call")
    add_client_security_arguments(parser)


def add_client_security_arguments(parser: argparse.ArgumentParser) -> None:
    """How a client proves itself to a secured --registry (client/auth.py); unset ones come from $LOADPLAN_*."""
    group = parser.add_argument_group("registry security (with --registry)")
    token = group.add_mutually_exclusive_group()
    token.add_argument("--token", metavar="TOKEN", default=None,
                       help="bearer token (default $LOADPLAN_TOKEN; prefer --token-file: argv is visible to ps)")
    token.add_argument("--token-file", metavar="FILE", default=None,
                       help="file holding the bearer token (default $LOADPLAN_TOKEN_FILE)")
    group.add_argument("--tls", action="store_true", default=None,
                       help="use TLS, trusting the system's CA roots (implied by --tls-ca/--tls-cert)")
    group.add_argument("--tls-ca", metavar="FILE", default=None,
                       help="CA certificate of the registry; turns TLS on (default $LOADPLAN_TLS_CA)")
    group.add_argument("--tls-cert", metavar="FILE", default=None,
                       help="client certificate for mutual TLS (default $LOADPLAN_TLS_CERT)")
    group.add_argument("--tls-key", metavar="FILE", default=None,
                       help="private key of --tls-cert (default $LOADPLAN_TLS_KEY)")


_SECURITY_FLAGS = (("token", "--token"), ("token_file", "--token-file"), ("tls", "--tls"), ("tls_ca", "--tls-ca"),
                   ("tls_cert", "--tls-cert"), ("tls_key", "--tls-key"))


def client_security(args: argparse.Namespace) -> dict[str, Any]:
    """RegistryClient keywords from the security flags; a file that cannot be used is INVALID_ARGUMENT."""
    from loadplan.client.auth import AuthConfigError, read_token_file

    try:
        token = read_token_file(args.token_file) if getattr(args, "token_file", None) else getattr(args, "token", None)
    except AuthConfigError as e:
        raise CliError("INVALID_ARGUMENT", f"--token-file: {one_line(e)}") from None
    return {"token": token, **{k: getattr(args, k, None) for k in ("tls", "tls_ca", "tls_cert", "tls_key")}}


@contextlib.contextmanager
def open_client(args: argparse.Namespace) -> Iterator[RegistryClient]:
    """A client of --registry, or of an embedded registry on --db (started here, stopped after)."""
    if getattr(args, "registry", None):
        from loadplan.client.auth import AuthConfigError

        try:
            client = RegistryClient(args.registry, timeout=args.timeout, **client_security(args))
        except AuthConfigError as e:
            raise CliError("INVALID_ARGUMENT", one_line(e)) from None
        with client:
            yield client
        return
    given = [flag for attr, flag in _SECURITY_FLAGS if getattr(args, attr, None)]
    if given:
        raise CliError("INVALID_ARGUMENT", f"{', '.join(given)} need --registry HOST:PORT: the embedded registry "
                       f"runs in this process, on loopback, without authentication or TLS")
    # The embedded server is plaintext and open: ignore $LOADPLAN_TOKEN / $LOADPLAN_TLS_* meant for a remote one.
    with embedded_registry(args.db or default_db_url()) as reg, \
            reg.client(timeout=args.timeout, token="", tls=False) as client:
        yield client


@contextlib.contextmanager
def embedded_registry(db_url: str):
    try:
        from loadplan.service.embedded import EmbeddedRegistry
        from loadplan.service.server import ServerStartError
    except ImportError as e:
        raise CliError("FAILED_PRECONDITION", f"the embedded registry needs loadplan[service] ({e}); "
                       f"install it or pass --registry HOST:PORT", EXIT_FAILURE) from None
    reg = EmbeddedRegistry(db_url)
    try:
        reg.start()
    except ValueError as e:            # make_engine: not a URL / unsupported database
        raise CliError("INVALID_ARGUMENT", f"--db: {one_line(e)}") from None
    except ServerStartError as e:
        raise CliError("FAILED_PRECONDITION", one_line(e)) from None
    except Exception as e:             # noqa: BLE001 - the database cannot be opened or migrated
        raise CliError("UNAVAILABLE", f"database {redact(db_url)}: {short_error(e)}") from None
    try:
        yield reg
    finally:
        reg.stop()


def redact(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001
        return url


def short_error(err: BaseException) -> str:
    """The first line of an exception, without SQLAlchemy's background link."""
    text = str(getattr(err, "orig", None) or err).strip().splitlines()
    return one_line(text[0] if text else type(err).__name__)


# --- a runner's request ----------------------------------------------------------

def add_runner_arguments(parser: argparse.ArgumentParser, *, engine: bool = True) -> None:
    """`engine`: the flags naming the engine that decides (`loadplan generate` runs loadplan's own
    engine, so it always asks for that one and offers none)."""
    parser.add_argument("--deployment", metavar="ID", help="deployment id (default: a fresh one)")
    parser.add_argument("--role", choices=ROLES, default="target")
    parser.add_argument("--request-id", metavar="ID", help="idempotency key (default: a fresh one)")
    for axis in ("tp", "ep", "pp", "dp"):
        parser.add_argument(f"--{axis}-size", type=int, default=1, metavar="N")
    for axis in ("tp", "ep", "pp", "dp"):
        parser.add_argument(f"--{axis}-rank", type=int, default=0, metavar="N")
    parser.add_argument("--a2a-backend", default="none", metavar="NAME", help="a2a backend (see `loadplan backends`)")
    parser.add_argument("--device", default="cpu", help="cpu|cuda:MAJOR.MINOR|hip:MAJOR.MINOR|musa:MAJOR.MINOR")
    if engine:
        add_engine_arguments(parser)
    parser.add_argument("--quantization", metavar="NAME", help="overrides the config's quantization_config")
    parser.add_argument("--enable-eplb", action="store_true")
    parser.add_argument("--ep-num-redundant-experts", type=int, default=0, metavar="N")
    parser.add_argument("--disable-shared-experts-fusion", action="store_true")
    parser.add_argument("--enforce-shared-experts-fusion", action="store_true")
    parser.add_argument("--enable-sbo", action="store_true")
    parser.add_argument("--enable-tbo", action="store_true")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default="", metavar="NAME",
                        help="the engine whose profile decides: loadplan, sglang or vllm (see `loadplan engines`); "
                             "default: loadplan on cpu, sglang on cuda/hip/musa")
    parser.add_argument("--engine-version", default="", metavar="V",
                        help="the engine's release (`loadplan engines`); default: its newest")
    parser.add_argument("--moe-runner-backend", default="", metavar="NAME",
                        help="SGLang's --moe-runner-backend, as SGLang spells it (sglang only; default auto)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="one of the engine's own server arguments, as the engine spells it (SGLang's ServerArgs "
                             "field, vLLM's config field); repeatable (`loadplan engines --inputs`: what each reads)")
    parser.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment switch of the engine (SGLANG_USE_AITER=1, ...); repeatable")
    parser.add_argument("--upgrade-from", default="", metavar="V",
                        help="an upgrade you name: the release the deployment's other runners run; runners of both "
                             "may share the deployment while every deployment-wide decision agrees")


def name_values(flag: str, items: list[str]) -> dict[str, str]:
    """NAME=VALUE items of a repeatable flag; a malformed or repeated one is INVALID_ARGUMENT naming it."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CliError("INVALID_ARGUMENT", f"{flag}: {item!r} is not NAME=VALUE")
        if name in out:
            raise CliError("INVALID_ARGUMENT", f"{flag}: {name} given twice")
        out[name] = value
    return out


def read_config(model: str) -> dict[str, Any]:
    """DIR/config.json (or the file itself); a bad file is INVALID_ARGUMENT naming it."""
    path = pathlib.Path(model)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CliError("INVALID_ARGUMENT", f"--model: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CliError("INVALID_ARGUMENT", f"--model: cannot read {path}: {one_line(e)}") from None
    try:
        config = json.loads(text)
    except ValueError as e:
        raise CliError("INVALID_ARGUMENT", f"config_json: {path} is not valid JSON ({e})") from None
    except RecursionError:
        raise CliError("INVALID_ARGUMENT", f"config_json: {path} is nested too deeply") from None
    if not isinstance(config, dict):
        raise CliError("INVALID_ARGUMENT", f"config_json: {path} must hold a JSON object, got "
                       f"{type(config).__name__}")
    return config


def request_from_args(args: argparse.Namespace, config: dict[str, Any]) -> ResolveRequest:
    return ResolveRequest(
        request_id=args.request_id or uuid.uuid4().hex,
        deployment_id=args.deployment or uuid.uuid4().hex,
        role=args.role,
        parallel=parallel_from_args(args),
        host=socket.gethostname(),
        config=config,
        quantization_config=config.get("quantization_config"),
        quantization=args.quantization,
        runtime=dataclasses.replace(runtime_from_args(args), device=args.device, engine=args.engine,
                                    engine_version=args.engine_version, moe_runner_backend=args.moe_runner_backend,
                                    engine_args=name_values("--engine-arg", args.engine_arg),
                                    engine_env=name_values("--engine-env", args.engine_env),
                                    upgrade_from=args.upgrade_from),
    )


def parallel_from_args(args: argparse.Namespace) -> Parallel:
    return Parallel(tp_size=args.tp_size, tp_rank=args.tp_rank, ep_size=args.ep_size, ep_rank=args.ep_rank,
                    pp_size=args.pp_size, pp_rank=args.pp_rank, dp_size=args.dp_size, dp_rank=args.dp_rank)


def runtime_from_args(args: argparse.Namespace) -> Runtime:
    """The runner flags as the contract's Runtime, but the device and the engine (`loadplan generate` runs
    loadplan's engine on a torch device, whose registry spelling its loader says)."""
    return Runtime(
        a2a_backend=args.a2a_backend, enable_sbo=args.enable_sbo, enable_tbo=args.enable_tbo,
        disable_shared_experts_fusion=args.disable_shared_experts_fusion,
        enforce_shared_experts_fusion=args.enforce_shared_experts_fusion,
        enable_eplb=args.enable_eplb, ep_num_redundant_experts=args.ep_num_redundant_experts,
    )
