"""Bearer tokens with roles, checked by a server interceptor before any handler runs.

Roles and what they may call are one table, `METHOD_ROLES`: a worker resolves
its plan and records later decisions, a reader inspects the history, an admin
does everything. A call to a ModelRegistry method without a recognised token is
answered UNAUTHENTICATED, one whose role is not in the method's row
PERMISSION_DENIED; either way the handler never runs, so nothing is written.
Health and reflection stay open: load balancers and `grpcurl` probe them.

Where tokens come from (`load_tokens`):
- a tokens file (`loadplan serve --tokens-file FILE`, or $LOADPLAN_TOKENS_FILE),
  one `ROLE:TOKEN` per line; blank lines and lines starting with `#` are
  skipped; `ROLE:sha256:HEX` gives the SHA-256 of a token instead of the token,
  so the file need not hold the secret itself:

      # role:token
      worker:4kq0V3n...            (printable ASCII, no spaces, >= 16 characters)
      admin:sha256:9f86d08188...   (hex digest of the token)

- $LOADPLAN_TOKENS: the same entries separated by commas or whitespace.
Both sources add up. In memory only the SHA-256 digests are kept; a presented
token is hashed and compared with every configured digest by
`hmac.compare_digest`, with no early exit, so timing tells neither whether nor
which entry matched. No token is ever logged or stored; error messages name a
line number, not its content.

With no tokens at all the server runs open (the embedded registry's default),
and says so in one log line at start.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import grpc

from loadplan.client.auth import AUTHORIZATION_KEY, AuthConfigError, check_token, read_text_file
from loadplan.v1 import registry_pb2 as pb

log = logging.getLogger("loadplan.service.auth")

TOKENS_ENV = "LOADPLAN_TOKENS"
TOKENS_FILE_ENV = "LOADPLAN_TOKENS_FILE"
MIN_TOKEN_CHARS = 16            # shorter ones can be guessed
SERVICE = pb.DESCRIPTOR.services_by_name["ModelRegistry"]

WORKER, READER, ADMIN = "worker", "reader", "admin"
ROLES = (WORKER, READER, ADMIN)

# Who may call what. A method missing here is admin-only (fail closed); `check_table` flags it.
METHOD_ROLES: dict[str, frozenset[str]] = {
    "ResolveLoadPlan": frozenset({WORKER, ADMIN}),
    "AppendDecisions": frozenset({WORKER, ADMIN}),
    "RecordObservedPlan": frozenset({WORKER, ADMIN}),
    "GetPlan": frozenset({WORKER, READER, ADMIN}),
    "ListPlans": frozenset({READER, ADMIN}),
    "DiffPlans": frozenset({READER, ADMIN}),
    "CheckUpgrade": frozenset({READER, ADMIN}),      # reads the history, writes nothing
    "ListBackends": frozenset({WORKER, READER, ADMIN}),
    "CheckCapabilities": frozenset({WORKER, READER, ADMIN}),   # decides, writes nothing
    "CheckCoverage": frozenset({WORKER, READER, ADMIN}),
    "Echo": frozenset({WORKER, READER, ADMIN}),
}


class TokenConfigError(AuthConfigError):
    """A tokens file or variable that cannot be used (the message names the place, never the token)."""


def check_table() -> list[str]:
    """Problems of METHOD_ROLES against the service definition; empty when consistent."""
    methods = set(SERVICE.methods_by_name)
    problems = [f"RPC {m} has no row in METHOD_ROLES (it is admin-only until it gets one)"
                for m in sorted(methods - set(METHOD_ROLES))]
    problems += [f"METHOD_ROLES names {m}, which the service does not have"
                 for m in sorted(set(METHOD_ROLES) - methods)]
    problems += [f"METHOD_ROLES[{m}] names unknown roles {sorted(r - set(ROLES))}"
                 for m, r in METHOD_ROLES.items() if r - set(ROLES)]
    problems += [f"METHOD_ROLES[{m}] leaves out admin" for m, r in METHOD_ROLES.items() if ADMIN not in r]
    return problems


def allowed_roles(method: str) -> frozenset[str]:
    return METHOD_ROLES.get(method, frozenset({ADMIN}))


# --- the token store -------------------------------------------------------------------

def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii")).digest()


_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    role: str


class TokenStore:
    """SHA-256 digests of the accepted tokens and their roles."""

    def __init__(self, entries: Iterable[tuple[bytes, str]] = ()):
        self._entries: tuple[_Entry, ...] = tuple(_Entry(d, r) for d, r in entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:       # counts only: a repr can end up in a log
        return f"TokenStore({self.summary()})"

    def summary(self) -> str:
        counts = {role: sum(e.role == role for e in self._entries) for role in ROLES}
        return ", ".join(f"{n} {role}" for role, n in counts.items() if n) or "no tokens"

    def role_of(self, token: str) -> str | None:
        """The role of `token`, or None. Compares against every digest whatever matched (constant time)."""
        try:
            presented = digest(token)
        except UnicodeEncodeError:
            presented = b"\0" * 32      # still walk the table: a refusal takes as long as any other
        role = None
        for entry in self._entries:
            if hmac.compare_digest(entry.digest, presented):
                role = entry.role
        return role


def parse_entries(entries: Iterable[tuple[str, str]]) -> TokenStore:
    """(where, "ROLE:TOKEN" or "ROLE:sha256:HEX") pairs -> a TokenStore; `where` names the entry in errors."""
    seen: dict[bytes, str] = {}
    out: list[tuple[bytes, str]] = []
    for where, text in entries:
        role, sep, secret = text.partition(":")
        role = role.strip()
        if not sep or not secret:
            raise TokenConfigError(f"{where}: expected ROLE:TOKEN or ROLE:sha256:HEX")
        if role not in ROLES:
            raise TokenConfigError(f"{where}: role {role!r} not supported; supported: {', '.join(ROLES)}")
        if secret.startswith("sha256:") and _HEX_DIGEST.fullmatch(secret[len("sha256:"):]):
            d = bytes.fromhex(secret[len("sha256:"):])
        else:
            try:
                check_token(secret, f"{where}: the token")
            except AuthConfigError as e:
                raise TokenConfigError(str(e)) from None
            if len(secret) < MIN_TOKEN_CHARS:
                raise TokenConfigError(f"{where}: the token is shorter than {MIN_TOKEN_CHARS} characters; use a "
                                       f"random one, e.g. python -c 'import secrets; print(secrets.token_urlsafe())'")
            d = digest(secret)
        if d in seen:
            raise TokenConfigError(f"{where}: the same token as {seen[d]}; each token has one role")
        seen[d] = where
        out.append((d, role))
    return TokenStore(out)


def _file_entries(path: str | os.PathLike) -> list[tuple[str, str]]:
    try:
        text = read_text_file(path, "tokens file")
    except AuthConfigError as e:
        raise TokenConfigError(str(e)) from None
    return [(f"tokens file {os.fspath(path)} line {n}", line.strip())
            for n, line in enumerate(text.splitlines(), 1) if line.strip() and not line.lstrip().startswith("#")]


def load_tokens(tokens_file: str | os.PathLike | None = None,
                environ: Mapping[str, str] = os.environ) -> TokenStore | None:
    """Tokens of `tokens_file` (else $LOADPLAN_TOKENS_FILE) plus $LOADPLAN_TOKENS; None when there are none."""
    entries: list[tuple[str, str]] = []
    path = tokens_file if tokens_file is not None else environ.get(TOKENS_FILE_ENV) or None
    if path is not None:
        entries += _file_entries(path)
    for n, item in enumerate(environ.get(TOKENS_ENV, "").replace(",", " ").split(), 1):
        entries.append((f"${TOKENS_ENV} entry {n}", item))
    if not entries:
        if path is not None:
            raise TokenConfigError(f"tokens file {os.fspath(path)} holds no tokens; the registry would run open")
        return None
    return parse_entries(entries)


# --- the interceptor -----------------------------------------------------------------------

_PREFIX = f"/{SERVICE.full_name}/"


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token of every ModelRegistry call against `tokens` and the method's roles
    (the registry serves with grpc.aio)."""

    def __init__(self, tokens: TokenStore):
        self.tokens = tokens

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        full = handler_call_details.method or ""
        if handler is None or not full.startswith(_PREFIX):
            return handler          # health, reflection, unknown methods (UNIMPLEMENTED): no token needed
        method = full[len(_PREFIX):]
        token, problem = _bearer(handler_call_details.invocation_metadata)
        if token is None:
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, method, problem)
        role = self.tokens.role_of(token)
        if role is None:
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, method,
                            "bearer token not recognised by this registry")
        allowed = allowed_roles(method)
        if role not in allowed:
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED, method,
                            f"role {role!r} may not call {method}; roles that may: {', '.join(sorted(allowed))}")
        return handler


def _bearer(metadata) -> tuple[str | None, str]:
    """The token of the single `authorization: Bearer ...` entry, or None and what is wrong."""
    values = [v for k, v in (metadata or ()) if k == AUTHORIZATION_KEY]
    if not values:
        return None, (f"no bearer token; send metadata '{AUTHORIZATION_KEY}: Bearer <token>' (loadplan: --token, "
                      f"--token-file or $LOADPLAN_TOKEN)")
    if len(values) > 1:
        return None, f"{len(values)} '{AUTHORIZATION_KEY}' metadata entries; send exactly one"
    value = values[0] if isinstance(values[0], str) else ""
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None, f"'{AUTHORIZATION_KEY}' metadata must be 'Bearer <token>'"
    return token, ""


def _refusal(handler, code: grpc.StatusCode, method: str, message: str):
    """A handler of the same shape that refuses; the request is never deserialized, the servicer never runs."""
    async def refuse(request_or_iterator, context):
        log.warning("%s refused: %s (peer %s)", method, code.name, context.peer())
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        factory = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        factory = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        factory = grpc.unary_stream_rpc_method_handler
    else:
        factory = grpc.unary_unary_rpc_method_handler
    return factory(refuse, request_deserializer=None, response_serializer=None)


def interceptors(tokens: TokenStore | None) -> list[grpc.aio.ServerInterceptor]:
    return [AuthInterceptor(tokens)] if tokens else []


def announce(tokens: TokenStore | None, address: str) -> None:
    """The one start-up line about authentication: a warning when a server reachable off this host is open."""
    if tokens:
        log.info("authentication on: bearer tokens (%s)", tokens.summary())
    elif _loopback(address):
        # The embedded registry's case: only this machine can connect; an info line keeps CLI output clean.
        log.info("authentication off: no tokens configured; open to every local caller on %s", address)
    else:
        log.warning("authentication off: no tokens configured (--tokens-file, $%s or $%s); every caller that "
                    "reaches %s may call every RPC", TOKENS_FILE_ENV, TOKENS_ENV, address)


def _loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
