"""EmbeddedRegistry: the real server and the SQL store in-process on a SQLite file."""

from __future__ import annotations

import dataclasses

import pytest
from sample_requests import decided, request

from loadplan.service.embedded import EmbeddedRegistry
from loadplan.service.healthcheck import check


def test_embedded_registry_round_trip_and_persistence(tmp_path):
    url = f"sqlite:///{tmp_path / 'e.db'}"
    req = request()
    with EmbeddedRegistry(url) as reg:
        assert reg.address.startswith("127.0.0.1:") and not reg.address.endswith(":0")
        assert check(reg.address)                     # migrated, so SERVING from the start
        with reg.client() as client:
            plan = client.resolve_load_plan(req)
            assert plan.request == decided(req)
            assert client.get_plan(plan.plan_id) == plan
    with EmbeddedRegistry(url) as reg, reg.client() as client:   # a second process on the same file
        again = client.resolve_load_plan(req)
        assert again.replayed and dataclasses.replace(again, replayed=False) == plan


def test_address_needs_a_started_registry(tmp_path):
    with pytest.raises(RuntimeError):
        EmbeddedRegistry(f"sqlite:///{tmp_path / 'x.db'}").address


def test_bad_url_is_refused_before_anything_starts():
    with pytest.raises(ValueError):
        EmbeddedRegistry("mysql://nobody@nowhere/db").start()


def test_embedded_client_ignores_credentials_meant_for_a_remote_registry(tmp_path, monkeypatch):
    # A worker configured for a TLS, token-protected registry still runs the embedded default.
    monkeypatch.setenv("LOADPLAN_TOKEN", "t" * 32)
    monkeypatch.setenv("LOADPLAN_TLS_CA", str(tmp_path / "no-such-ca.pem"))
    with EmbeddedRegistry(f"sqlite:///{tmp_path / 'e.db'}") as reg, reg.client() as client:
        assert client.resolve_load_plan(request()).plan_id
