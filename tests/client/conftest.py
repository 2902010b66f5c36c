"""Fixtures: a real in-process registry server on 127.0.0.1:0 over the in-memory fake store."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "service"))

from fake_store import FakePlanStore  # noqa: E402

from loadplan.client import RegistryClient  # noqa: E402
from loadplan.service.server import RegistryServer, ServerOptions  # noqa: E402



@pytest.fixture
def store() -> FakePlanStore:
    return FakePlanStore()


@pytest.fixture
def server(store):
    srv = RegistryServer(store, ServerOptions(listen="127.0.0.1:0", max_workers=4, readiness_interval_s=0.05))
    srv.start()
    yield srv
    srv.stop(grace=0.5)


@pytest.fixture
def client(server):
    with RegistryClient(server.address, timeout=5.0, backoff=0.01) as c:
        yield c
