"""`PgAsyncWriter`: new plans written to PostgreSQL from the server's event loop.

The registry serves gRPC with grpc.aio: every call is a coroutine on one thread.
A resolve awaits its plan's group commit here, and the batch goes out on a
psycopg `AsyncConnection` of the same loop (its statement prepared once per
connection and run on libpq directly: service/store/pq_statement.py). So a plan
costs no thread hand-off
(the sync server parked an RPC thread per resolve and woke it after the
commit: under load, waking threads under the GIL cost as much as the rest of
the resolve) and a batch no SQLAlchemy round of its own.

What is written, and how refusals and races are decided, is `SqlPlanStore`'s,
unchanged (service/store/repository.py):
- group commit (`AsyncPlanWriter`, service/store/async_writer.py): the plans that
  arrive while a batch is being written go in the next one; at most
  `max_leaders` batches at once, each on its own connection;
- each batch first runs the optimistic statement (`SqlPlanStore.fast_statement`):
  one autocommitted statement, one round trip with its commit;
- what it leaves (a pin set elsewhere, inputs whose JSON differs from the pin's)
  or refuses as a whole (a stored request id, a deadlock) goes the careful way,
  `SqlPlanStore._write_carefully`, on a thread of `executor`;
- a plan answers only after the statement (or transaction) holding it committed.

Every wait is bounded like the engine's (service/store/db.py): libpq's connect
and TCP timeouts and the server's statement_timeout come with the engine's
connection parameters, and each statement also runs under the engine's
operation timeout here (a stalled server or proxy). A connection that failed or
overran is closed; its batch's callers get UNAVAILABLE and retry with the same
request id. A connection idle longer than `PING_IF_IDLE_S` is pinged before use
(as the engine's pool does), so a database that restarted meanwhile costs no
caller an error.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from concurrent.futures import Executor
from typing import Any, Callable, Sequence

import psycopg

from ..errors import Unavailable
from ..registry import NewPlan
from . import pq_statement
from .async_writer import FILL_WAIT_S, AsyncPlanWriter
from .db import PING_IF_IDLE_S, operation_timeout, psycopg_connect_kwargs, shut_down_socket
from .repository import MAX_BATCH, SqlPlanStore, _Item, _Retry, _translate_errors

# One batch at a time: a batch is one statement, so there is nothing of the next batch to overlap
# with this one's commit, and the plans that arrive meanwhile make the next batch bigger (cheaper
# per plan).
PG_ASYNC_LEADERS = 1


class PgAsyncWriter(AsyncPlanWriter):
    """`save(new)`: `SqlPlanStore.save_plan` for coroutines of ONE event loop (the one it is used on)."""

    def __init__(self, store: SqlPlanStore, executor: Executor | None = None, *,
                 max_leaders: int = PG_ASYNC_LEADERS, max_batch: int = MAX_BATCH,
                 fill_wait_s: float = FILL_WAIT_S):
        if store.engine.dialect.name != "postgresql":
            raise ValueError(f"PgAsyncWriter writes to PostgreSQL, not {store.engine.dialect.name}")
        super().__init__(store, executor, max_leaders=max_leaders, max_batch=max_batch, fill_wait_s=fill_wait_s)
        self._connect_kwargs = psycopg_connect_kwargs(store.engine)
        self._timeout = operation_timeout(store.engine)
        self._idle: list[tuple[psycopg.AsyncConnection, float]] = []
        self._prepared_on: weakref.WeakKeyDictionary[psycopg.AsyncConnection, set[bytes]] = \
            weakref.WeakKeyDictionary()
        # Called as hook(connection, sql) right before each statement of a batch (tests cut
        # connections there, as SQLAlchemy's before_cursor_execute event lets them on the engine).
        self.before_statement: list[Callable[[psycopg.AsyncConnection, str], None]] = []

    async def _release(self) -> None:
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            await self._discard(conn)

    # --- batches -------------------------------------------------------------------

    async def _write(self, news: Sequence[NewPlan]) -> list[Any]:
        """One outcome per plan (a plan, an exception, or DEFER), as `SqlPlanStore._save_batch`."""
        store = self.store
        outcomes, todo, items = store._batch_items(news)
        if not items:
            return outcomes
        try:
            results = await self._write_items(items)
        except Unavailable as err:
            # Nothing of the batch is known committed: each caller retries with its request id.
            results = [Unavailable(err.message) for _ in items]
        except Exception as err:  # noqa: BLE001 - a plan the database refuses must not fail the others
            results = [err] if len(items) == 1 else await self._blocking(
                lambda: [store._write_alone(item) for item in items])
        for i, result in zip(todo, results):
            outcomes[i] = result
        return outcomes

    async def _write_items(self, items: list[_Item]) -> list[Any]:
        store = self.store
        fast = store.fast_statement(items)
        inserted = None
        if fast.sql is not None:
            try:
                with _translate_errors("saving a plan"):
                    inserted = await self._execute(fast.sql, fast.params, fast.returns_plan_ids)
            except _Retry:   # a stored request id, a deadlock: nothing of the statement was written
                return await self._blocking(store._write_carefully, items)
        results, pinned, left = store.fast_outcomes(items, fast, inserted)
        store._pins.remember(pinned)   # committed with the statement
        if left:
            careful = await self._blocking(store._write_carefully, [items[k] for k in left])
            for k, result in zip(left, careful):
                results[k] = result
        return results

    # --- connections ---------------------------------------------------------------

    async def _execute(self, sql: str, params: tuple, returns_rows: bool) -> set[str] | None:
        """Run one autocommitted statement (`pq_statement`, prepared once per connection); the
        first column of its rows when `returns_rows`. A connection whose statement failed is
        dropped, whatever the failure: a refusal is rare (a replay, a race) and a fresh
        connection is never in doubt."""
        conn = await self._connection()
        healthy = False
        try:
            for hook in self.before_statement:
                hook(conn, sql)
            rows = await self._bounded(conn, pq_statement.run(conn, self._prepared(conn), sql, params))
            healthy = True
            return set(rows) if returns_rows else None
        finally:
            if healthy:
                self._idle.append((conn, time.monotonic()))
            else:
                await self._discard(conn)

    def _prepared(self, conn: psycopg.AsyncConnection) -> set[bytes]:
        """The names of the statements prepared on `conn` (forgotten with the connection)."""
        return self._prepared_on.setdefault(conn, set())

    async def _connection(self) -> psycopg.AsyncConnection:
        """An idle connection (pinged if idle for long), else a new one; errors translated by the caller."""
        while self._idle:
            conn, since = self._idle.pop()
            if conn.closed or conn.broken:
                continue
            if time.monotonic() - since < PING_IF_IDLE_S:
                return conn
            try:
                await self._bounded(conn, conn.execute("SELECT 1"))
                return conn
            except psycopg.Error:
                await self._discard(conn)
        # libpq's connect_timeout (in the engine's parameters) bounds this.
        return await psycopg.AsyncConnection.connect(autocommit=True, **self._connect_kwargs)

    async def _bounded(self, conn: psycopg.AsyncConnection, awaitable):
        """Await a call on `conn`, at most the operation timeout: then its socket is shut down, which
        fails the call at once with a connection error. (Cancelling it instead makes psycopg send
        the server a cancel request and wait for its answer: no bound against a stalled server.)"""
        if self._timeout is None:
            return await awaitable
        timer = asyncio.get_running_loop().call_later(self._timeout, shut_down_socket, conn)
        try:
            return await awaitable
        finally:
            timer.cancel()

    @staticmethod
    async def _discard(conn: psycopg.AsyncConnection) -> None:
        try:
            await conn.close()
        except Exception:  # noqa: BLE001 - it is being dropped anyway
            pass
