"""Fixtures: a throw-away PKI made with `cryptography`, tokens per role, and secured servers.

Nothing is committed: the CA, the server certificate (SAN 127.0.0.1 and
localhost), a client certificate, and a rogue CA with its own client certificate
are generated once per session into a temporary directory.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import pathlib
import secrets
import sys
from dataclasses import dataclass

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # tests/service: fake_store, sample_requests

from fake_store import FakePlanStore  # noqa: E402

from loadplan.service.auth import ROLES, load_tokens  # noqa: E402
from loadplan.service.server import RegistryServer, ServerOptions  # noqa: E402

from cryptography import x509  # noqa: E402  (the dev extra)
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402


@dataclass(frozen=True)
class Pki:
    ca: pathlib.Path
    server_cert: pathlib.Path
    server_key: pathlib.Path
    client_cert: pathlib.Path
    client_key: pathlib.Path
    rogue_ca: pathlib.Path            # a CA nobody trusts
    rogue_client_cert: pathlib.Path   # a client certificate it signed
    rogue_client_key: pathlib.Path


def _name(cn: str):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, key, issuer_name, issuer_key, *, ca: bool, sans=(), usage=None):
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: pathlib.Path, stem: str, cert, key) -> tuple[pathlib.Path, pathlib.Path]:
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _ca(directory: pathlib.Path, stem: str):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _issue(f"loadplan test {stem}", key, _name(f"loadplan test {stem}"), key, ca=True)
    path, _ = _write(directory, stem, cert, key)
    return cert, key, path


def _leaf(directory, stem, ca_cert, ca_key, *, sans=(), usage):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _issue(stem, key, ca_cert.subject, ca_key, ca=False, sans=sans, usage=usage)
    return _write(directory, stem, cert, key)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_cert, ca_key, ca_path = _ca(d, "ca")
    server = _leaf(d, "server", ca_cert, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH,
                   sans=(x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))))
    client = _leaf(d, "client", ca_cert, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue_cert, rogue_key, rogue_path = _ca(d, "rogue-ca")
    rogue_client = _leaf(d, "rogue-client", rogue_cert, rogue_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(ca_path, *server, *client, rogue_path, *rogue_client)


@pytest.fixture(scope="session")
def tokens() -> dict[str, str]:
    """A fresh random token per role (the server only ever sees their digests)."""
    return {role: f"lp-{role}-{secrets.token_urlsafe(24)}" for role in ROLES}


@pytest.fixture(scope="session")
def token_store(tokens):
    return load_tokens(environ={"LOADPLAN_TOKENS": ",".join(f"{r}:{t}" for r, t in tokens.items())})


@pytest.fixture
def start_server():
    """Factory: a started RegistryServer on 127.0.0.1:0 (FakePlanStore unless given); all stopped at the end."""
    started: list[RegistryServer] = []

    def start(store=None, **options) -> RegistryServer:
        options.setdefault("listen", "127.0.0.1:0")
        options.setdefault("max_workers", 4)
        srv = RegistryServer(store if store is not None else FakePlanStore(), ServerOptions(**options)).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop(grace=0.2)
