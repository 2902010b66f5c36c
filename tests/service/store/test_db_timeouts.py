"""PostgreSQL calls are bounded (service/store/db.py): the server's statement_timeout, and the
watchdog that cuts a call the server does not answer in time; the engine recovers after."""

from __future__ import annotations

import dataclasses
import time

import pytest
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from loadplan.errors import FailedPrecondition
from loadplan.service.registry import Registry
from loadplan.service.store.db import WATCHDOG, make_engine, operation_timeout
from loadplan.service.store.repository import SqlPlanStore


def test_statement_timeout_is_set_and_configurable(postgres_url):
    engine = make_engine(postgres_url, operation_timeout_s=1.5)
    try:
        assert operation_timeout(engine) == 1.5
        with engine.connect() as c:
            assert c.exec_driver_sql("SHOW statement_timeout").scalar() == "1500ms"
    finally:
        engine.dispose()


def test_options_of_the_caller_are_kept(postgres_url):
    engine = make_engine(postgres_url, connect_args={"options": "-c timezone=Asia/Tokyo"})
    try:
        with engine.connect() as c:
            assert c.exec_driver_sql("SHOW timezone").scalar() == "Asia/Tokyo"
            assert c.exec_driver_sql("SHOW statement_timeout").scalar() != "0"
    finally:
        engine.dispose()


def test_unbounded_engine_for_migrations(postgres_url):
    engine = make_engine(postgres_url, operation_timeout_s=None)
    try:
        assert operation_timeout(engine) is None
        with engine.connect() as c:
            assert c.exec_driver_sql("SHOW statement_timeout").scalar() == "0"
    finally:
        engine.dispose()


def test_a_call_the_server_does_not_answer_is_cut_and_the_engine_recovers(postgres_url):
    engine = make_engine(postgres_url, operation_timeout_s=1.0)
    try:
        fired = WATCHDOG.fired
        t = time.monotonic()
        with pytest.raises(sa_exc.OperationalError):
            with engine.connect() as c:
                # Turned off server-side, so only the watchdog can end this wait.
                c.exec_driver_sql("SET statement_timeout = 0")
                c.exec_driver_sql("SELECT pg_sleep(30)")
        took = time.monotonic() - t
        assert 0.9 <= took < 5, took
        assert WATCHDOG.fired > fired
        with engine.connect() as c:   # a fresh connection: the cut one was dropped
            assert c.execute(sa.text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()


def test_fast_calls_are_not_cut(postgres_url):
    engine = make_engine(postgres_url, operation_timeout_s=0.5)
    try:
        fired = WATCHDOG.fired
        with engine.connect() as c:
            for _ in range(3):
                c.exec_driver_sql("SELECT 1")
                time.sleep(0.4)        # idle time in between is not a call
            c.commit()
            time.sleep(0.7)            # nor is holding a connection after its commit
            assert c.exec_driver_sql("SELECT 2").scalar() == 2
        assert WATCHDOG.fired == fired
    finally:
        engine.dispose()


def test_pipelined_saves_leave_their_connection_as_they_found_it(postgres_url, make_request):
    """A batch runs its transaction in autocommit mode with its own pipelined BEGIN
    (db.borrow_autocommit); committed, refused or rolled back, the connection goes back to the
    pool out of autocommit mode, so the next transaction is one transaction again."""
    engine = make_engine(postgres_url, pool_size=1, max_overflow=0)
    try:
        registry = Registry(SqlPlanStore(engine))

        def autocommit() -> bool:
            with engine.connect() as c:
                return c.connection.dbapi_connection.autocommit

        first = make_request()
        plan = registry.resolve(first)
        assert autocommit() is False
        # The same request id again: the optimistic batch fails inside its pipeline (unique
        # violation), rolls back and replays carefully.
        assert registry.resolve(first).plan_id == plan.plan_id
        assert autocommit() is False
        with pytest.raises(FailedPrecondition):
            registry.resolve(dataclasses.replace(first, host="elsewhere"))
        assert autocommit() is False
        assert registry.get_plan(plan.plan_id).plan_id == plan.plan_id
    finally:
        engine.dispose()
