"""Retention: prune the plans of the history older than a cutoff, keeping what the registry still reads.

The history grows by one plan per rank per (re)start of every runner. `prune_plans(engine, before)`
deletes the plans created before `before`, with their decision revisions (`decisions`) and their
append records (`decision_appends`), except:
- a plan a deployment pin references: the deployment's first rank, whose inputs every later rank of
  the deployment is checked against, and which the audit shows the deployment was planned with;
- a plan with a decision revision recorded at or after `before` (AppendDecisions): still in use.

It runs in batches of `batch_size` plans, one write transaction each: a prune that fails or is
stopped leaves whole plans (a plan, its revisions and its append records go together or not at
all), and a running registry is held up one batch at a time. On PostgreSQL the batch's plans are
locked and plans locked by someone else are left for the next prune (an AppendDecisions being
written). `dry_run` counts and deletes nothing.

A pruned plan's request id is forgotten: a client retrying with it after the prune gets a new plan,
not the pruned one replayed. Prune beyond your clients' retry horizon (the CLI refuses a cutoff
less than a minute old).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .db import writer
from .models import DecisionAppendRow, DecisionRow, DeploymentPinRow, PlanRow

PLANS, DECISIONS = PlanRow.__table__, DecisionRow.__table__
APPENDS, PINS = DecisionAppendRow.__table__, DeploymentPinRow.__table__
DEFAULT_BATCH = 1000


@dataclass(frozen=True)
class PruneReport:
    before: dt.datetime
    older: int           # plans created before `before`, when the prune started
    kept_pinned: int     # ... of which a deployment pin references
    kept_active: int     # ... not pinned, with a decision revision at or after `before`
    pruned: int          # deleted (dry run: would be)
    batches: int         # transactions committed (dry run: 0)
    dry_run: bool


# Uncorrelated `IN (SELECT ...)`: each database evaluates the set once (SQLite into a temporary index,
# PostgreSQL as a hashed subplan). A correlated EXISTS made SQLite scan the pins once per plan (no index
# on deployment_pins.plan_id): 115 s to count 100,000 plans against 10,000 pins, against 0.3 s this way.
def _pinned():
    return PLANS.c.plan_id.in_(sa.select(PINS.c.plan_id))


def _active(before: dt.datetime):
    return PLANS.c.plan_id.in_(sa.select(DECISIONS.c.plan_id).where(DECISIONS.c.decided_at >= before))


def _count(conn, *where) -> int:
    return conn.execute(sa.select(sa.func.count()).select_from(PLANS).where(*where)).scalar_one()


def prune_plans(engine: Engine, before: dt.datetime, *, dry_run: bool = False,
                batch_size: int = DEFAULT_BATCH) -> PruneReport:
    """Delete the plans created before `before` that no pin references and nothing was decided on since."""
    if before.tzinfo is None:
        raise ValueError(f"before must be timezone-aware, got {before!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    old = PLANS.c.created_at < before
    with engine.connect() as conn:
        older = _count(conn, old)
        pinned = _count(conn, old, _pinned())
        active = _count(conn, old, ~_pinned(), _active(before))
    pruned = batches = 0
    if dry_run:
        pruned = older - pinned - active
    else:
        while True:
            deleted = _prune_batch(engine, before, batch_size)
            if not deleted:
                break
            pruned += deleted
            batches += 1
    return PruneReport(before, older, pinned, active, pruned, batches, dry_run)


def _prune_batch(engine: Engine, before: dt.datetime, batch_size: int) -> int:
    """One transaction: up to `batch_size` prunable plans and what hangs off them; how many went."""
    with writer(engine).begin() as conn:
        pick = (sa.select(PLANS.c.plan_id)
                .where(PLANS.c.created_at < before, ~_pinned(), ~_active(before))
                .order_by(PLANS.c.created_at, PLANS.c.plan_id)
                .limit(batch_size))
        if conn.dialect.name == "postgresql":
            pick = pick.with_for_update(of=PLANS, skip_locked=True)
        ids = conn.execute(pick).scalars().all()
        if not ids:
            return 0
        conn.execute(sa.delete(APPENDS).where(APPENDS.c.plan_id.in_(ids)))
        conn.execute(sa.delete(DECISIONS).where(DECISIONS.c.plan_id.in_(ids)))
        deleted = conn.execute(sa.delete(PLANS).where(PLANS.c.plan_id.in_(ids))).rowcount
        if deleted != len(ids):   # somebody deleted some meanwhile (another prune): start this batch over
            raise RuntimeError(f"pruning: {len(ids) - deleted} of {len(ids)} plans vanished meanwhile")
        return deleted
