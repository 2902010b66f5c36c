"""Alembic environment for the loadplan history database.

Two ways in:
- programmatic (`service.store.db.migrate`): the caller hands an open connection
  inside its transaction through `config.attributes["connection"]`;
- the alembic CLI: the URL comes from `config.attributes["url"]`, the ini's
  sqlalchemy.url, or LOADPLAN_DB_URL, and the engine from `make_engine`.
Batch mode on SQLite, whose ALTER TABLE cannot change constraints.
"""

from __future__ import annotations

import os

from alembic import context

from loadplan.service.store.db import make_engine, writer
from loadplan.service.store.models import Base

target_metadata = Base.metadata


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        transaction_per_migration=False,
    )


def _url():
    cfg = context.config
    url = cfg.attributes.get("url") or cfg.get_main_option("sqlalchemy.url") or os.environ.get("LOADPLAN_DB_URL")
    if not url:
        raise RuntimeError("no database URL: pass --db URL to `loadplan migrate` or set LOADPLAN_DB_URL")
    return url


def run_migrations_offline() -> None:
    from loadplan.service.store.db import normalize_url

    context.configure(url=normalize_url(_url()), target_metadata=target_metadata,
                      literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url())
    try:
        with writer(engine).connect() as connection:
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


# Only run inside an alembic command: importing this module elsewhere (packaging
# checks that import every module) must not fail.
if getattr(context, "_proxy", None) is not None or hasattr(context, "config"):
    if context.is_offline_mode():
        run_migrations_offline()
    else:
        run_migrations_online()
