"""Shared fixtures: databases for the store and everything above it.

PostgreSQL comes from LOADPLAN_TEST_POSTGRES_URL (a server the tests may create
databases on, e.g. postgresql+psycopg://postgres@127.0.0.1:5432/postgres):
- unset: tests that need it are skipped (under CI=true: they fail, see `in_ci`);
- set but unreachable: they FAIL, so CI cannot pass without PostgreSQL by accident.
The tests never touch the database named in the URL: they create fresh, uniquely
named databases on that server and drop them at the end of the session.
"""

from __future__ import annotations

import os
import uuid

import pytest

PG_ENV = "LOADPLAN_TEST_POSTGRES_URL"


def _threads_per_worker() -> None:
    """Under pytest-xdist, each worker (and the processes its tests start) gets its share of the cores
    for OpenMP, torch's intra-op pool. With the default, every worker's pool takes all the cores, and
    pools spinning against each other made the engine's tests 2-5 times slower (two workers on two
    cores: 19 s against 4 s for one module). Set here, at the conftest's import, before any test
    module imports torch; an OMP_NUM_THREADS given by the caller is kept. Tests that need more
    threads set them (torch.set_num_threads)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))


_threads_per_worker()

# Under CI (CI=true, which .ci/run sets) a test never skips: a skip there means a tool or an environment is missing
# (Chromium, a C++ compiler, SGLang's or vLLM's environment, PostgreSQL), and CI must not pass without it. Each skip
# message says how to install what is missing; under CI it becomes the failure's message.
def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _failed_in_ci(report) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true, which fails: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        _failed_in_ci(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    if in_ci() and report.skipped:
        _failed_in_ci(report)


def pytest_collection_modifyitems(config, items):
    """Modules marked `heavy(seconds)` run first, the longest first (the sort is stable: every other order stays).
    `make test`'s two workers take whole files in collection order, so a long file left to the end keeps one
    worker busy alone for a minute after the other has finished. The seconds are a module's serial time here."""
    def weight(item):
        mark = item.get_closest_marker("heavy")
        return -mark.args[0] if mark is not None else 0
    items.sort(key=weight)


def _admin_engine(server_url: str):
    from loadplan.service.store.db import make_engine

    # CREATE/DROP DATABASE cannot run in a transaction; they are bounded, but not by the
    # registry's 5 s per statement, which a busy CI machine could exceed copying a template.
    return make_engine(server_url, operation_timeout_s=60, connect_args={"connect_timeout": 5}).execution_options(
        isolation_level="AUTOCOMMIT")


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    """The server URL from LOADPLAN_TEST_POSTGRES_URL, checked reachable."""
    url = os.environ.get(PG_ENV)
    if not url:
        pytest.skip(f"{PG_ENV} not set: PostgreSQL tests skipped (set {PG_ENV}="
                    f"postgresql+psycopg://postgres@127.0.0.1:5432/postgres for a local server; bash .ci/run does)")
    engine = _admin_engine(url)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except Exception as exc:   # noqa: BLE001 - any failure to connect is the same verdict
        pytest.fail(f"{PG_ENV}={url} is set but PostgreSQL is unreachable: {exc}", pytrace=False)
    finally:
        engine.dispose()
    return url


@pytest.fixture(scope="session")
def make_postgres_database(postgres_server_url):
    """Factory: a fresh, empty (unmigrated) database on the test server; returns its URL."""
    from loadplan.service.store.db import normalize_url

    admin = _admin_engine(postgres_server_url)
    created: list[str] = []

    def make() -> str:
        name = f"loadplan_test_{uuid.uuid4().hex[:12]}"
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        created.append(name)
        return normalize_url(postgres_server_url).set(database=name).render_as_string(hide_password=False)

    yield make
    with admin.connect() as conn:
        for name in created:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture(scope="session")
def postgres_url(make_postgres_database) -> str:
    """A migrated PostgreSQL database shared by the session's tests (use unique ids per test)."""
    from loadplan.service.store.db import migrate

    url = make_postgres_database()
    migrate(url)
    return url


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    """A migrated SQLite file of this test alone."""
    from loadplan.service.store.db import migrate

    url = f"sqlite:///{tmp_path / 'registry.db'}"
    migrate(url)
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request) -> str:
    """A migrated database URL, once per supported database."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def db_engine(db_url):
    """A SQLAlchemy engine on `db_url`, disposed after the test."""
    from loadplan.service.store.db import make_engine

    eng = make_engine(db_url)
    yield eng
    eng.dispose()
