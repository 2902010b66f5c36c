"""TLS for the registry's port: server certificate, and mutual TLS when a client CA is given.

    ServerTls(cert="registry.pem", key="registry.key")                       # TLS
    ServerTls(cert="registry.pem", key="registry.key", client_ca="ca.pem")   # mutual TLS

With a client CA, a client must present a certificate that CA signed, or the
handshake fails (the call never reaches the server's handlers). The files are
read once, when the server binds its port. The client side is
`loadplan.client.auth.ClientTls` (the client package must not import the service).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc

from loadplan.client.auth import AuthConfigError, PemSource, read_pem


class TlsConfigError(AuthConfigError, RuntimeError):
    """Certificate files that cannot be used. A RuntimeError too, so the server's bind errors cover it."""


@dataclass(frozen=True)
class ServerTls:
    cert: PemSource
    key: PemSource
    client_ca: PemSource | None = None      # given: mutual TLS, clients need a certificate it signed

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        try:
            key = read_pem(self.key, "TLS key", "PRIVATE KEY-----")
            cert = read_pem(self.cert, "TLS certificate", "-----BEGIN CERTIFICATE-----")
            ca = read_pem(self.client_ca, "TLS client CA", "-----BEGIN CERTIFICATE-----") if self.mutual else None
        except AuthConfigError as e:
            raise TlsConfigError(str(e)) from None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=self.mutual)

    def describe(self) -> str:
        return "mutual TLS (client certificates required)" if self.mutual else "TLS"


def add_port(server: grpc.Server, listen: str, tls: ServerTls | None) -> int:
    """Bind `listen` with TLS when `tls` is given, plaintext otherwise; the port bound (0: failed)."""
    if tls is None:
        return server.add_insecure_port(listen)
    return server.add_secure_port(listen, tls.credentials())


def describe(tls: ServerTls | None) -> str:
    return tls.describe() if tls is not None else "plaintext"


def server_tls(cert: str | os.PathLike | None, key: str | os.PathLike | None,
               client_ca: str | os.PathLike | None = None) -> ServerTls | None:
    """From command-line style options: all None is plaintext; a client CA or a lone cert/key is an error."""
    if cert is None and key is None:
        if client_ca is not None:
            raise TlsConfigError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
        return None
    if cert is None or key is None:
        raise TlsConfigError("--tls-cert and --tls-key go together: give both or neither")
    return ServerTls(cert, key, client_ca)
