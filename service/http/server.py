"""`HttpServer`: the HTTP app (service/http/app.py) on uvicorn, on a thread of its own.

uvicorn is the ASGI server Starlette recommends, well kept, with TLS and client
certificates of its own. It gets a socket bound here (so a busy address is an
error at start, and port 0 gives the port actually bound) and runs its own
event loop on a daemon thread, apart from the gRPC server's loop: a slow page
never delays a resolve. The gRPC port's TLS (service/tls.py) applies here too:
the same certificate and key, and with a client CA the same mutual TLS.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import tempfile
import threading

import uvicorn

from loadplan.client.auth import read_pem
from ..tls import ServerTls


class HttpStartError(RuntimeError):
    """The HTTP server cannot start: a bad address, or one already in use."""


def _bind(listen: str) -> socket.socket:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise HttpStartError(f"--http: {listen!r} is not HOST:PORT")
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise HttpStartError(f"--http: cannot listen on {listen}: {e.strerror or e}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class HttpServer:
    def __init__(self, app, listen: str, tls: ServerTls | None = None):
        self._sock = _bind(listen)
        host = listen.rpartition(":")[0]
        self.port = self._sock.getsockname()[1]
        self.address = f"{host}:{self.port}"
        self.scheme = "https" if tls is not None else "http"
        self._pem_dir = tempfile.TemporaryDirectory(prefix="loadplan-http-tls-") if tls is not None else None
        kwargs = self._tls_kwargs(tls) if tls is not None else {}
        # lifespan off: the app has no startup work; access log off: the registry logs its own way.
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", **kwargs)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="loadplan-http", daemon=True)

    def _tls_kwargs(self, tls: ServerTls) -> dict:
        """uvicorn reads certificates from files: a PEM given as bytes is written to a private file."""
        def path(source, name: str, what: str, marker: str) -> str:
            if not isinstance(source, bytes):
                return os.fspath(source)
            file = os.path.join(self._pem_dir.name, name)
            with open(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(read_pem(source, what, marker))
            return file

        kwargs = {"ssl_certfile": path(tls.cert, "cert.pem", "TLS certificate", "-----BEGIN CERTIFICATE-----"),
                  "ssl_keyfile": path(tls.key, "key.pem", "TLS key", "PRIVATE KEY-----")}
        if tls.mutual:
            kwargs["ssl_ca_certs"] = path(tls.client_ca, "ca.pem", "TLS client CA", "-----BEGIN CERTIFICATE-----")
            kwargs["ssl_cert_reqs"] = ssl.CERT_REQUIRED
        return kwargs

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def start(self) -> "HttpServer":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()
        if self._pem_dir is not None:
            self._pem_dir.cleanup()

    def __enter__(self) -> "HttpServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
