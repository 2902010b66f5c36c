"""Fixtures of the store tests: a store and a registry on each database, row counts."""

from __future__ import annotations

import uuid

import pytest

from loadplan.plan import Parallel, ResolveRequest, Runtime
from loadplan.service.registry import Registry
from loadplan.service.store.repository import SqlPlanStore
from store_helpers import DEEPSEEK_V3, count_rows


@pytest.fixture
def store(db_engine) -> SqlPlanStore:
    return SqlPlanStore(db_engine)


@pytest.fixture
def registry(store) -> Registry:
    return Registry(store)


@pytest.fixture
def rows(db_engine):
    """rows() -> {table: row count} on the test's database."""
    return lambda: count_rows(db_engine)


@pytest.fixture
def deployment() -> str:
    """A deployment id of this test alone (the PostgreSQL database is shared by the session)."""
    return f"dep-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def make_request(deployment):
    """make_request(**overrides) -> a valid DeepSeek-V3 request with a fresh request id."""

    def make(**kw) -> ResolveRequest:
        base = dict(request_id=f"req-{uuid.uuid4().hex}", deployment_id=deployment, role="target",
                    parallel=Parallel(), host="node-0", config=DEEPSEEK_V3, quantization_config=None,
                    quantization=None, runtime=Runtime())
        base.update(kw)
        return ResolveRequest(**base)

    return make
