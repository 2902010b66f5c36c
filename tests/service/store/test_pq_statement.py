"""pq_statement: the writer's statements on libpq directly (service/store/pq_statement.py)."""

from __future__ import annotations

import asyncio
import datetime as dt

import psycopg
import pytest

from loadplan.service.store import pq_statement
from loadplan.service.store.db import make_engine, psycopg_connect_kwargs


def test_placeholders_are_numbered_and_the_name_follows_the_text():
    name, text = pq_statement.statement("INSERT INTO t (a, b) SELECT %s::text, %s::integer")
    assert text == b"INSERT INTO t (a, b) SELECT $1::text, $2::integer"
    assert pq_statement.statement("INSERT INTO t (a, b) SELECT %s::text, %s::integer")[0] == name
    assert pq_statement.statement("SELECT %s")[0] != name


@pytest.mark.parametrize("sql", ["SELECT '100%%'", "SELECT %(a)s"])
def test_other_placeholders_are_refused(sql):
    with pytest.raises(ValueError, match="only %s placeholders"):
        pq_statement.statement(sql)


def test_parameters_in_text_form():
    at = dt.datetime(2026, 11, 29, 12, 30, tzinfo=dt.timezone.utc)
    assert [pq_statement.text_param(v) for v in (None, "h\u00e9", True, False, 42, at)] == \
        [None, "h\u00e9".encode(), b"t", b"f", b"42", b"2026-11-29T12:30:00+00:00"]
    with pytest.raises(ValueError, match="naive"):
        pq_statement.text_param(dt.datetime(2026, 11, 29))
    with pytest.raises(TypeError, match="float"):
        pq_statement.text_param(1.5)


@pytest.fixture
def conninfo(postgres_url):
    engine = make_engine(postgres_url)
    yield psycopg_connect_kwargs(engine)
    engine.dispose()


def run_on_connection(conninfo, body):
    async def main():
        conn = await psycopg.AsyncConnection.connect(autocommit=True, **conninfo)
        try:
            return await body(conn)
        finally:
            await conn.close()
    return asyncio.run(main())


def test_rows_come_back_and_a_statement_is_prepared_once_per_connection(conninfo):
    sql = "SELECT x || %s::text FROM unnest(ARRAY['a', 'b']) AS x WHERE %s::boolean"

    async def body(conn):
        prepared: set[bytes] = set()
        first = await pq_statement.run(conn, prepared, sql, ("-\u00e9", True))
        second = await pq_statement.run(conn, prepared, sql, ("-2", False))
        cur = await conn.execute("SELECT count(*) FROM pg_prepared_statements WHERE name = %s",
                                 (pq_statement.statement(sql)[0].decode(),))
        return first, second, prepared, (await cur.fetchone())[0]

    first, second, prepared, on_server = run_on_connection(conninfo, body)
    assert first == ["a-\u00e9", "b-\u00e9"] and second == []
    assert prepared == {pq_statement.statement(sql)[0]} and on_server == 1


def test_a_parameter_larger_than_the_socket_buffer_is_sent_whole(conninfo):
    big = "x" * (4 << 20)

    async def body(conn):
        return await pq_statement.run(conn, set(), "SELECT length(%s::text)::text", (big,))

    assert run_on_connection(conninfo, body) == [str(len(big))]


def test_a_refusal_raises_the_psycopg_error_of_its_sqlstate(conninfo):
    async def body(conn):
        await conn.execute("CREATE TEMP TABLE pq_t (k text PRIMARY KEY)")
        prepared: set[bytes] = set()
        await pq_statement.run(conn, prepared, "INSERT INTO pq_t VALUES (%s)", ("k1",))
        with pytest.raises(psycopg.errors.UniqueViolation) as info:
            await pq_statement.run(conn, prepared, "INSERT INTO pq_t VALUES (%s)", ("k1",))
        assert info.value.sqlstate == "23505"
        cur = await conn.execute("SELECT count(*) FROM pq_t")
        return (await cur.fetchone())[0]

    assert run_on_connection(conninfo, body) == 1     # autocommitted, the refused one not written


def test_a_connection_that_is_cut_raises_operational_error(conninfo, postgres_url):
    async def body(conn):
        pid = conn.info.backend_pid
        async with await psycopg.AsyncConnection.connect(autocommit=True, **conninfo) as admin:
            await admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))   # waits until it is gone
        with pytest.raises(psycopg.OperationalError):
            await pq_statement.run(conn, set(), "SELECT %s::text", ("x",))

    run_on_connection(conninfo, body)
