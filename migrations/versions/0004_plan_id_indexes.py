"""Indexes on the two foreign keys to plans that had none: deployment_pins.plan_id and
decision_appends.plan_id.

Deleting a plan (`loadplan prune`, service/store/retention.py) makes the database check
that no pin and no append record still references it. Without an index on the
referencing column that check scans the whole table once per deleted plan, on SQLite
and PostgreSQL alike: pruning 90,000 plans of a history with 10,000 pins took 73 s on
SQLite, most of it in those scans. The indexes cost one more entry per pin written (one
per deployment and role) and per append; nothing else a resolve writes.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""
from __future__ import annotations

from typing import Sequence, Union

from alembic import op

revision: str = "0004"
down_revision: Union[str, Sequence[str], None] = "0003"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

INDEXES = (("ix_deployment_pins_plan_id", "deployment_pins"), ("ix_decision_appends_plan_id", "decision_appends"))


def upgrade() -> None:
    for name, table in INDEXES:
        op.create_index(name, table, ["plan_id"])


def downgrade() -> None:
    for name, table in INDEXES:
        op.drop_index(name, table_name=table)
