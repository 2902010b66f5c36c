"""How long `loadplan prune` takes on a large history: seconds to count (dry run) and to delete.

    python bench/prune.py [--postgres-url URL] [--plans N] [--ranks-per-deployment R] [--batch-size N] [--json]

For each database (a fresh SQLite file; and, with --postgres-url or
LOADPLAN_TEST_POSTGRES_URL, a fresh PostgreSQL database dropped afterwards) it
migrates to head, writes N plans created long ago as the ranks of deployments of
R ranks each (rank 0 of each pinned, as the registry pins a deployment's first
rank), then times `prune_plans` (service/store/retention.py): its dry run, then
the prune itself. The rows are inserted directly, many per statement, so that
a large history takes seconds to build, not a registry's worth of resolves.
Prints one row (or JSON object) per database.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
import uuid

import sqlalchemy as sa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from registry import _fresh_postgres  # noqa: E402  (bench/registry.py: a uniquely named database)

from loadplan.service.store.db import make_engine, migrate  # noqa: E402
from loadplan.service.store.models import DeploymentPinRow, PlanRow  # noqa: E402
from loadplan.service.store.retention import DEFAULT_BATCH, prune_plans  # noqa: E402

CREATED = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
CUTOFF = CREATED + dt.timedelta(days=1)
CHUNK = 5000   # rows per INSERT


def seed(engine, n_plans: int, ranks: int) -> None:
    """n_plans plans created at CREATED, the ranks of deployments of `ranks` ranks, rank 0 of each pinned."""
    plans, pins = PlanRow.__table__, DeploymentPinRow.__table__
    with engine.begin() as conn:
        for start in range(0, n_plans, CHUNK):
            rows, pinned = [], []
            for i in range(start, min(start + CHUNK, n_plans)):
                plan_id, deployment, rank = uuid.uuid4().hex, f"bench-{i // ranks}", i % ranks
                rows.append(dict(
                    plan_id=plan_id, request_id=plan_id, request_fingerprint="bench", deployment_id=deployment,
                    role="target", host="bench", tp_size=1, tp_rank=0, ep_size=ranks, ep_rank=rank, pp_size=1,
                    pp_rank=0, dp_size=1, dp_rank=0, entry_class="DeepseekV3ForCausalLM", config_fingerprint="bench",
                    config_json="{}", quantization=None, requested_quantization=None, quantization_config_json=None,
                    runtime_json="{}", ruleset_version="bench", created_at=CREATED, decisions_json="[]"))
                if rank == 0:
                    pinned.append(dict(deployment_id=deployment, role="target", inputs_json="{}",
                                       ruleset_version="bench", plan_id=plan_id, created_at=CREATED))
            conn.execute(sa.insert(plans), rows)
            if pinned:
                conn.execute(sa.insert(pins), pinned)


def measure(url: str, db: str, n_plans: int, ranks: int, batch_size: int) -> dict:
    migrate(url)
    engine = make_engine(url, operation_timeout_s=None)
    try:
        seed(engine, n_plans, ranks)
        t = time.perf_counter()
        dry = prune_plans(engine, CUTOFF, dry_run=True)
        counted = time.perf_counter() - t
        t = time.perf_counter()
        done = prune_plans(engine, CUTOFF, batch_size=batch_size)
        pruned = time.perf_counter() - t
    finally:
        engine.dispose()
    assert dry.pruned == done.pruned == n_plans - dry.kept_pinned, (dry, done)
    return {"db": db, "plans": n_plans, "kept_pinned": done.kept_pinned, "pruned": done.pruned,
            "batches": done.batches, "dry_run_s": round(counted, 3), "prune_s": round(pruned, 3),
            "plans_per_s": round(done.pruned / pruned) if pruned else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--postgres-url", default=os.environ.get("LOADPLAN_TEST_POSTGRES_URL"))
    ap.add_argument("--plans", type=int, default=100_000)
    ap.add_argument("--ranks-per-deployment", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=DEFAULT_BATCH)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(measure(f"sqlite:///{tmp}/history.db", "sqlite", args.plans, args.ranks_per_deployment,
                            args.batch_size))
    if args.postgres_url:
        url, drop = _fresh_postgres(args.postgres_url)
        try:
            rows.append(measure(url, "postgresql", args.plans, args.ranks_per_deployment, args.batch_size))
        finally:
            drop()
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
