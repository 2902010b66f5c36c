"""`serve --http` takes the gRPC port's TLS: the same certificate, and with a client CA mutual TLS."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request

import pytest
from fake_store import FakePlanStore

from loadplan.service.http.app import create_app
from loadplan.service.http.server import HttpServer
from loadplan.service.metrics import RegistryMetrics
from loadplan.service.registry import Registry
from loadplan.service.tls import ServerTls


def _app():
    return create_app(Registry(FakePlanStore()), RegistryMetrics())


def _get(url: str, context: ssl.SSLContext) -> int:
    with urllib.request.urlopen(url, timeout=5, context=context) as r:
        return r.status


def test_https_with_the_grpc_certificate(pki):
    with HttpServer(_app(), "127.0.0.1:0", ServerTls(pki.server_cert, pki.server_key)) as http:
        assert http.scheme == "https"
        trusted = ssl.create_default_context(cafile=str(pki.ca))
        assert _get(f"https://{http.address}/metrics", trusted) == 200
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            _get(f"https://{http.address}/metrics", ssl.create_default_context(cafile=str(pki.rogue_ca)))


def test_mutual_tls_needs_a_client_certificate_the_ca_signed(pki):
    tls = ServerTls(pki.server_cert.read_bytes(), pki.server_key.read_bytes(), pki.ca.read_bytes())   # PEM bytes too
    with HttpServer(_app(), "127.0.0.1:0", tls) as http:
        url = f"https://{http.address}/metrics"
        with_cert = ssl.create_default_context(cafile=str(pki.ca))
        with_cert.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        assert _get(url, with_cert) == 200
        rogue = ssl.create_default_context(cafile=str(pki.ca))
        rogue.load_cert_chain(str(pki.rogue_client_cert), str(pki.rogue_client_key))
        for context in (ssl.create_default_context(cafile=str(pki.ca)), rogue):
            with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
                _get(url, context)
