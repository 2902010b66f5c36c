"""A plan's resolved decisions in one column of its row: plans.decisions_json.

A resolve used to write one `decisions` row per decision (a dozen rows, each with
its primary-key entry and foreign-key check) besides the plan row; the database
spent more on those than on the plan. From this revision the resolved decisions
(revision 0, decided at the plan's created_at) travel in the plan row as one JSON
array of [key, value, reason, rule, deployment_wide], and `decisions` holds the
appended revisions. Plans written before keep their rows (decisions_json NULL);
readers take both.

Downgrade moves each plan's decisions_json back into revision-0 rows first, so
nothing is lost either way.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""
from __future__ import annotations

import json
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: Union[str, Sequence[str], None] = "0001"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column("plans", sa.Column("decisions_json", sa.Text(), nullable=True))


def downgrade() -> None:
    conn = op.get_bind()
    plans = sa.table("plans", sa.column("plan_id", sa.String), sa.column("decisions_json", sa.Text),
                     sa.column("created_at", sa.DateTime(timezone=True)))
    decisions = sa.table("decisions", sa.column("plan_id", sa.String), sa.column("key", sa.String),
                         sa.column("revision", sa.Integer), sa.column("value_json", sa.Text),
                         sa.column("reason", sa.Text), sa.column("rule", sa.String),
                         sa.column("deployment_wide", sa.Boolean), sa.column("decided_at", sa.DateTime(timezone=True)))
    rows = conn.execute(sa.select(plans.c.plan_id, plans.c.decisions_json, plans.c.created_at)
                        .where(plans.c.decisions_json.is_not(None))).all()
    values = [dict(plan_id=plan_id, key=key, revision=0, value_json=json.dumps(value, ensure_ascii=False),
                   reason=reason, rule=rule, deployment_wide=bool(wide), decided_at=created_at)
              for plan_id, text, created_at in rows
              for key, value, reason, rule, wide in json.loads(text)]
    if values:
        conn.execute(sa.insert(decisions), values)
    # Plain ALTER TABLE on both databases (SQLite >= 3.35): Alembic's batch mode would copy the
    # table and DROP the original, which the other tables' foreign keys refuse.
    op.execute("ALTER TABLE plans DROP COLUMN decisions_json")
