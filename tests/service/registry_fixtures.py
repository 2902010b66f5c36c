"""Fixtures: a real in-process registry server on 127.0.0.1:0 over the in-memory fake store.

Shared by the conftests of tests/client, tests/cli and tests/service/transport, which put
tests/service on sys.path and import `store`, `server` and `client` from here.
"""

from __future__ import annotations

import pytest
from fake_store import FakePlanStore

from loadplan.client import RegistryClient
from loadplan.service.server import RegistryServer, ServerOptions


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
