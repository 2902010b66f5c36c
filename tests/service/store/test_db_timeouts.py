"""PostgreSQL calls are bounded (service/store/db.py): the server's statement_timeout, and the
watchdog that cuts a call the server does not answer in time; the engine recovers after."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from loadplan.service.store.db import WATCHDOG, make_engine, operation_timeout


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
