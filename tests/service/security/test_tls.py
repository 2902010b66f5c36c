"""TLS and mutual TLS with certificates generated for the session (conftest.py)."""

from __future__ import annotations

import pytest
from fake_store import FakePlanStore
from sample_requests import request

from loadplan.client import RegistryCallError, RegistryClient
from loadplan.client.auth import AuthConfigError, ClientTls
from loadplan.service import healthcheck
from loadplan.service.server import ServerStartError
from loadplan.service.tls import ServerTls, TlsConfigError, server_tls


def tls_client(server, *, host="127.0.0.1", **kw) -> RegistryClient:
    kw.setdefault("max_attempts", 1)     # a handshake failure is UNAVAILABLE: no point in retrying it here
    return RegistryClient(f"{host}:{server.port}", timeout=5.0, **kw)


def refused(client) -> str:
    with pytest.raises(RegistryCallError) as info:
        client.resolve_load_plan(request())
    return info.value.code


@pytest.fixture
def tls_server(start_server, pki):
    store = FakePlanStore()
    return start_server(store, tls=ServerTls(pki.server_cert, pki.server_key)), store


@pytest.fixture
def mtls_server(start_server, pki):
    store = FakePlanStore()
    return start_server(store, tls=ServerTls(pki.server_cert, pki.server_key, client_ca=pki.ca)), store


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_resolve_round_trip_over_tls(tls_server, pki, host):
    server, store = tls_server
    with tls_client(server, host=host, tls_ca=pki.ca) as client:
        plan = client.resolve_load_plan(request())
        assert client.get_plan(plan.plan_id).plan_id == plan.plan_id
    assert store.count() == 1


def test_ca_given_as_pem_bytes(tls_server, pki):
    server, _ = tls_server
    with tls_client(server, tls_ca=pki.ca.read_bytes()) as client:
        assert client.echo(b"x") == b"x"


def test_plaintext_client_against_tls_server_fails(tls_server):
    server, store = tls_server
    with tls_client(server, tls=False) as client:
        assert refused(client) == "UNAVAILABLE"
    assert store.save_calls == []


def test_tls_client_against_plaintext_server_fails(start_server, pki):
    store = FakePlanStore()
    server = start_server(store)
    with tls_client(server, tls_ca=pki.ca) as client:
        assert refused(client) == "UNAVAILABLE"
    assert store.save_calls == []


def test_a_server_certificate_from_an_untrusted_ca_is_refused(tls_server, pki):
    server, store = tls_server
    with tls_client(server, tls_ca=pki.rogue_ca) as client:
        assert refused(client) == "UNAVAILABLE"
    assert store.save_calls == []


def test_mutual_tls_with_a_client_certificate(mtls_server, pki):
    server, store = mtls_server
    with tls_client(server, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key) as client:
        client.resolve_load_plan(request())
    assert store.count() == 1


@pytest.mark.parametrize("cert", [None, "rogue"], ids=["no-client-cert", "cert-of-another-ca"])
def test_mutual_tls_refuses_clients_without_a_trusted_certificate(mtls_server, pki, cert):
    server, store = mtls_server
    kw = {} if cert is None else {"tls_cert": pki.rogue_client_cert, "tls_key": pki.rogue_client_key}
    with tls_client(server, tls_ca=pki.ca, **kw) as client:
        assert refused(client) == "UNAVAILABLE"
    assert store.save_calls == [] and store.count() == 0


def test_tls_settings_from_the_environment(mtls_server, pki, monkeypatch):
    server, store = mtls_server
    monkeypatch.setenv("LOADPLAN_TLS_CA", str(pki.ca))
    monkeypatch.setenv("LOADPLAN_TLS_CERT", str(pki.client_cert))
    monkeypatch.setenv("LOADPLAN_TLS_KEY", str(pki.client_key))
    with tls_client(server) as client:
        client.resolve_load_plan(request())
    assert store.count() == 1


def test_tls_and_tokens_together(start_server, pki, token_store, tokens):
    store = FakePlanStore()
    server = start_server(store, tokens=token_store, tls=ServerTls(pki.server_cert, pki.server_key, pki.ca))
    mtls = dict(tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key)
    with tls_client(server, token=tokens["worker"], **mtls) as client:
        client.resolve_load_plan(request())
    with tls_client(server, token=tokens["reader"], **mtls) as client:
        assert refused(client) == "PERMISSION_DENIED"
    assert store.count() == 1


def test_healthcheck_speaks_tls(mtls_server, pki, capsys):
    server, _ = mtls_server
    address = f"127.0.0.1:{server.port}"
    assert healthcheck.main([address, "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert),
                             "--tls-key", str(pki.client_key)]) == 0
    assert healthcheck.main([address, "--tls-ca", str(pki.ca), "--timeout", "1"]) == 1   # no client certificate
    assert capsys.readouterr().out.split() == ["SERVING", "NOT_SERVING"]


def test_unusable_files_are_clear_errors(start_server, pki, tmp_path):
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(ServerStartError, match="TLS certificate .*not.pem is not a PEM file"):
        start_server(tls=ServerTls(not_pem, pki.server_key))
    with pytest.raises(ServerStartError, match="TLS key .*missing.key: cannot read it"):
        start_server(tls=ServerTls(pki.server_cert, tmp_path / "missing.key"))
    with pytest.raises(AuthConfigError, match="TLS CA certificate .*not.pem is not a PEM file"):
        RegistryClient("127.0.0.1:1", tls_ca=not_pem)
    with pytest.raises(AuthConfigError, match="go together"):
        ClientTls(ca=pki.ca, cert=pki.client_cert)
    with pytest.raises(TlsConfigError, match="--tls-client-ca needs --tls-cert and --tls-key"):
        server_tls(None, None, pki.ca)
    with pytest.raises(TlsConfigError, match="go together"):
        server_tls(pki.server_cert, None)
