"""The history database: SQLAlchemy 2 typed models (DESIGN section 6).

One `Base`, one MetaData with a naming convention, so Alembic revisions and the
models name every constraint and index the same way on SQLite and PostgreSQL.

Tables:
- `plans`: one row per resolved runner plan, with every input it was made from
  (the request can be rebuilt exactly from the row);
- `decisions`: every revision of every decision of a plan (revision 0 comes
  from the resolve, later ones from `append_decisions`, e.g. EPLB rebalances);
- `deployment_pins`: the deployment-wide inputs of the first rank of each
  (deployment, role); every later rank must match them;
- `decision_appends`: the request ids of `append_decisions` calls (idempotency).
"""

from __future__ import annotations

import datetime as dt
from typing import Optional

from sqlalchemy import (
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Column sizes. Ids follow the request validation in service/rules/resolve.py.
ID_LEN = 128
FINGERPRINT_LEN = 64   # sha256 hex
NAME_LEN = 128


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC datetime on every database.

    PostgreSQL keeps the instant (TIMESTAMPTZ) but answers in the session's time
    zone; SQLite has no time zone at all. So: refuse naive values on the way in,
    store UTC (naive on SQLite, where the fixed-width text sorts chronologically),
    and always hand back datetimes in `timezone.utc`.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: the store keeps timezone-aware UTC times only")
        value = value.astimezone(dt.timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class PlanRow(Base):
    __tablename__ = "plans"

    plan_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(ID_LEN), unique=True)
    # sha256 of the whole request but its id: tells a retry from a reused id.
    request_fingerprint: Mapped[str] = mapped_column(String(FINGERPRINT_LEN))

    deployment_id: Mapped[str] = mapped_column(String(ID_LEN))
    role: Mapped[str] = mapped_column(String(16))
    host: Mapped[str] = mapped_column(String(255))

    tp_size: Mapped[int] = mapped_column(Integer)
    tp_rank: Mapped[int] = mapped_column(Integer)
    ep_size: Mapped[int] = mapped_column(Integer)
    ep_rank: Mapped[int] = mapped_column(Integer)
    pp_size: Mapped[int] = mapped_column(Integer)
    pp_rank: Mapped[int] = mapped_column(Integer)
    dp_size: Mapped[int] = mapped_column(Integer)
    dp_rank: Mapped[int] = mapped_column(Integer)

    entry_class: Mapped[str] = mapped_column(String(NAME_LEN))
    config_fingerprint: Mapped[str] = mapped_column(String(FINGERPRINT_LEN))
    config_json: Mapped[str] = mapped_column(Text)                      # the whole config.json
    # The quantization the rules settled on, and the name the request asked for
    # (None: derived from quantization_config); both are needed to rebuild the request.
    quantization: Mapped[Optional[str]] = mapped_column(String(NAME_LEN))
    requested_quantization: Mapped[Optional[str]] = mapped_column(String(NAME_LEN))
    quantization_config_json: Mapped[Optional[str]] = mapped_column(Text)   # NULL: no quantization config
    # Runtime as JSON: its fields grow with the engine; a JSON column needs no migration per flag.
    runtime_json: Mapped[str] = mapped_column(Text)

    ruleset_version: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    # The decisions the plan was resolved with (revision 0 of each key, decided at created_at),
    # as one JSON array of [key, value, reason, rule, deployment_wide]: written with the plan
    # row, so a resolve is one row, not one per decision (revision 0002). Later revisions
    # (AppendDecisions) are rows of `decisions`; so are the resolved decisions of plans written
    # before 0002, whose decisions_json is NULL.
    decisions_json: Mapped[Optional[str]] = mapped_column(Text)

    __table_args__ = (
        # ListPlans filters, each ending in the keyset order (created_at desc, plan_id desc).
        Index("ix_plans_deployment_id_role_created_at", "deployment_id", "role", "created_at"),
        Index("ix_plans_entry_class_created_at", "entry_class", "created_at"),
        Index("ix_plans_created_at_plan_id", "created_at", "plan_id"),
    )


class DecisionRow(Base):
    """A revision of a plan's decision: the appended ones (AppendDecisions, revision >= 1), and
    the resolved ones (revision 0) of plans written before revision 0002 (see decisions_json)."""

    __tablename__ = "decisions"

    # The primary key is the unique (plan_id, key, revision): two writers that
    # compute the same next revision collide instead of both landing.
    plan_id: Mapped[str] = mapped_column(ForeignKey("plans.plan_id"), primary_key=True)
    key: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    revision: Mapped[int] = mapped_column(Integer, primary_key=True)
    value_json: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(Text)
    rule: Mapped[str] = mapped_column(String(NAME_LEN))
    deployment_wide: Mapped[bool] = mapped_column(Boolean)
    decided_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())


class DeploymentPinRow(Base):
    __tablename__ = "deployment_pins"

    deployment_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    role: Mapped[str] = mapped_column(String(16), primary_key=True)
    inputs_json: Mapped[str] = mapped_column(Text)        # deployment_inputs of the first rank
    ruleset_version: Mapped[str] = mapped_column(String(32))
    plan_id: Mapped[str] = mapped_column(ForeignKey("plans.plan_id"))   # the first rank's plan
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())

    # Deleting a plan checks that no pin references it (retention.py); revision 0004.
    __table_args__ = (Index("ix_deployment_pins_plan_id", "plan_id"),)


class DecisionAppendRow(Base):
    __tablename__ = "decision_appends"

    request_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    plan_id: Mapped[str] = mapped_column(ForeignKey("plans.plan_id"))
    # sha256 of (plan id, decisions): a retry replays, a reused id is refused.
    request_fingerprint: Mapped[str] = mapped_column(String(FINGERPRINT_LEN))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())

    __table_args__ = (Index("ix_decision_appends_plan_id", "plan_id"),)   # as the pins' (revision 0004)
