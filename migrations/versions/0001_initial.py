"""Initial schema: plans, decisions, deployment pins, decision appends.

Written by hand to match service/store/models.py exactly (a test compares the
migrated schema with the models on SQLite and PostgreSQL). Constraint and index
names follow the models' naming convention.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""
from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: Union[str, Sequence[str], None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def _utc() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "plans",
        sa.Column("plan_id", sa.String(64), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("request_fingerprint", sa.String(64), nullable=False),
        sa.Column("deployment_id", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        *[sa.Column(f"{axis}_{what}", sa.Integer(), nullable=False)
          for axis in ("tp", "ep", "pp", "dp") for what in ("size", "rank")],
        sa.Column("entry_class", sa.String(128), nullable=False),
        sa.Column("config_fingerprint", sa.String(64), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("quantization", sa.String(128), nullable=True),
        sa.Column("requested_quantization", sa.String(128), nullable=True),
        sa.Column("quantization_config_json", sa.Text(), nullable=True),
        sa.Column("runtime_json", sa.Text(), nullable=False),
        sa.Column("ruleset_version", sa.String(32), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("plan_id", name="pk_plans"),
        sa.UniqueConstraint("request_id", name="uq_plans_request_id"),
    )
    op.create_index("ix_plans_deployment_id_role_created_at", "plans", ["deployment_id", "role", "created_at"])
    op.create_index("ix_plans_entry_class_created_at", "plans", ["entry_class", "created_at"])
    op.create_index("ix_plans_created_at_plan_id", "plans", ["created_at", "plan_id"])

    op.create_table(
        "decisions",
        sa.Column("plan_id", sa.String(64), nullable=False),
        sa.Column("key", sa.String(128), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("value_json", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("rule", sa.String(128), nullable=False),
        sa.Column("deployment_wide", sa.Boolean(), nullable=False),
        sa.Column("decided_at", _utc(), nullable=False),
        sa.ForeignKeyConstraint(["plan_id"], ["plans.plan_id"], name="fk_decisions_plan_id_plans"),
        sa.PrimaryKeyConstraint("plan_id", "key", "revision", name="pk_decisions"),
    )

    op.create_table(
        "deployment_pins",
        sa.Column("deployment_id", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("inputs_json", sa.Text(), nullable=False),
        sa.Column("ruleset_version", sa.String(32), nullable=False),
        sa.Column("plan_id", sa.String(64), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.ForeignKeyConstraint(["plan_id"], ["plans.plan_id"], name="fk_deployment_pins_plan_id_plans"),
        sa.PrimaryKeyConstraint("deployment_id", "role", name="pk_deployment_pins"),
    )

    op.create_table(
        "decision_appends",
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("plan_id", sa.String(64), nullable=False),
        sa.Column("request_fingerprint", sa.String(64), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.ForeignKeyConstraint(["plan_id"], ["plans.plan_id"], name="fk_decision_appends_plan_id_plans"),
        sa.PrimaryKeyConstraint("request_id", name="pk_decision_appends"),
    )


def downgrade() -> None:
    op.drop_table("decision_appends")
    op.drop_table("deployment_pins")
    op.drop_table("decisions")
    op.drop_index("ix_plans_created_at_plan_id", table_name="plans")
    op.drop_index("ix_plans_entry_class_created_at", table_name="plans")
    op.drop_index("ix_plans_deployment_id_role_created_at", table_name="plans")
    op.drop_table("plans")
