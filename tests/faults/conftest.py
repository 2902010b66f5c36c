"""Fixtures of the fault tests: a fresh PostgreSQL database per module, a proxy to it.

Every module gets its own migrated database (`make_postgres_database`, dropped at
the end of the session), so one module's storm cannot disturb another's audit.
"""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from loadplan.service.store.db import make_engine, migrate
from tcp_proxy import TcpProxy


@pytest.fixture(scope="module")
def pg_db(make_postgres_database) -> str:
    """A migrated PostgreSQL database of this module alone (its URL)."""
    url = make_postgres_database()
    migrate(url)
    return url


@pytest.fixture(scope="module")
def pg_engine(pg_db):
    """A direct engine on `pg_db`, for the audit (never through the proxy)."""
    engine = make_engine(pg_db)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_proxy(pg_db):
    """(proxy, url through the proxy): the registry's link to PostgreSQL, cuttable."""
    u = make_url(pg_db)
    proxy = TcpProxy(u.host or "127.0.0.1", u.port or 5432)
    try:
        yield proxy, u.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    finally:
        proxy.close()
