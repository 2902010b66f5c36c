"""What a client presents to a secured registry: a bearer token and TLS settings.

The token travels as call metadata `authorization: Bearer <token>` on every
call (not as gRPC call credentials, which gRPC only allows on TLS channels, so
the same client also works against a plaintext registry on loopback). Over a
network, use TLS: a bearer token on a plaintext channel can be read on the wire.

Each setting a caller leaves unset (None) falls back to the environment, so
engine workers pick them up without code changes:

    LOADPLAN_TOKEN        the bearer token itself
    LOADPLAN_TOKEN_FILE   a file holding it (surrounding whitespace ignored)
    LOADPLAN_TLS_CA       PEM file of the CA that signed the registry's certificate
    LOADPLAN_TLS_CERT     PEM file of this client's certificate (mutual TLS)
    LOADPLAN_TLS_KEY      PEM file of its private key

TLS is on when any of the three TLS settings is given (a CA of None then means
the system's roots), or when asked for with `tls=True`; `tls=False` forces
plaintext and ignores the TLS variables. Error messages name files and
settings, never a token's value.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Mapping, Union

import grpc

TOKEN_ENV = "LOADPLAN_TOKEN"
TOKEN_FILE_ENV = "LOADPLAN_TOKEN_FILE"
TLS_CA_ENV = "LOADPLAN_TLS_CA"
TLS_CERT_ENV = "LOADPLAN_TLS_CERT"
TLS_KEY_ENV = "LOADPLAN_TLS_KEY"
AUTHORIZATION_KEY = "authorization"      # gRPC metadata keys are lower case
BEARER = "Bearer"

PemSource = Union[str, os.PathLike, bytes]   # a file path, or the PEM text itself as bytes


class AuthConfigError(ValueError):
    """A token or TLS setting that cannot be used; the message never contains a token."""


# --- tokens -------------------------------------------------------------------------

def check_token(token: str, what: str = "token") -> str:
    """A token usable as an HTTP/2 header value: printable ASCII, no spaces."""
    if not token:
        raise AuthConfigError(f"{what} is empty")
    if not all("!" <= ch <= "~" for ch in token):
        raise AuthConfigError(f"{what} must be printable ASCII without spaces or control characters")
    return token


def read_text_file(path: str | os.PathLike, what: str) -> str:
    """A UTF-8 file's text; AuthConfigError naming `what` and the path (never the content) otherwise."""
    try:
        return pathlib.Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise AuthConfigError(f"{what} {os.fspath(path)}: cannot read it ({e.strerror or type(e).__name__})") \
            from None
    except UnicodeDecodeError:
        raise AuthConfigError(f"{what} {os.fspath(path)} is not UTF-8 text") from None


def read_token_file(path: str | os.PathLike, what: str = "token file") -> str:
    text = read_text_file(path, what)
    return check_token(text.strip(), f"the token in {what} {os.fspath(path)}")


def resolve_token(token: str | None, token_file: str | os.PathLike | None = None,
                  environ: Mapping[str, str] = os.environ) -> str | None:
    """token, else token_file, else $LOADPLAN_TOKEN, else $LOADPLAN_TOKEN_FILE; "" means none at all."""
    if token is not None:
        return check_token(token) if token else None
    if token_file is not None:
        return read_token_file(token_file)
    if environ.get(TOKEN_ENV):
        return check_token(environ[TOKEN_ENV], f"${TOKEN_ENV}")
    if environ.get(TOKEN_FILE_ENV):
        return read_token_file(environ[TOKEN_FILE_ENV], f"${TOKEN_FILE_ENV}")
    return None


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((AUTHORIZATION_KEY, f"{BEARER} {token}"),) if token else ()


# --- TLS ------------------------------------------------------------------------------

def read_pem(source: PemSource, what: str, marker: str = "-----BEGIN ") -> bytes:
    """PEM bytes from a path or from bytes, checked to look like PEM (gRPC's own errors for bad PEM are opaque)."""
    if isinstance(source, bytes):
        data, where = source, "(given as bytes)"
    else:
        where = os.fspath(source)
        try:
            data = pathlib.Path(source).read_bytes()
        except OSError as e:
            raise AuthConfigError(f"{what} {where}: cannot read it ({e.strerror or type(e).__name__})") from None
    if marker.encode() not in data:
        raise AuthConfigError(f"{what} {where} is not a PEM file (no '{marker.strip()}' line)")
    return data


@dataclass(frozen=True)
class ClientTls:
    """TLS of a client channel: `ca` None trusts the system's roots; `cert`+`key` present a client certificate."""

    ca: PemSource | None = None
    cert: PemSource | None = None
    key: PemSource | None = None
    server_name: str | None = None      # check the certificate against this name instead of the address's host

    def __post_init__(self):
        if (self.cert is None) != (self.key is None):
            raise AuthConfigError("a client certificate and its key go together: give both (--tls-cert and "
                                  "--tls-key) or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "TLS CA certificate") if self.ca is not None else None,
            private_key=read_pem(self.key, "TLS client key") if self.key is not None else None,
            certificate_chain=read_pem(self.cert, "TLS client certificate") if self.cert is not None else None)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def resolve_tls(tls: bool | None = None, ca: PemSource | None = None, cert: PemSource | None = None,
                key: PemSource | None = None, server_name: str | None = None,
                environ: Mapping[str, str] = os.environ) -> ClientTls | None:
    """The TLS settings of a client (None: plaintext), unset ones taken from $LOADPLAN_TLS_*."""
    if tls is False:
        if ca is not None or cert is not None or key is not None:
            raise AuthConfigError("tls=False contradicts the TLS CA/certificate/key that were given")
        return None
    ca = ca if ca is not None else environ.get(TLS_CA_ENV) or None
    cert = cert if cert is not None else environ.get(TLS_CERT_ENV) or None
    key = key if key is not None else environ.get(TLS_KEY_ENV) or None
    if tls is None and ca is None and cert is None and key is None:
        return None
    return ClientTls(ca, cert, key, server_name)


def open_channel(address: str, tls: ClientTls | None, options: list | None = None) -> grpc.Channel:
    options = list(options or ())
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.credentials(), options=options + tls.channel_options())
