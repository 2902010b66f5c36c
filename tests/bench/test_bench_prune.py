"""bench/prune.py runs and reports what it pruned (its figures are measurements, not checked here)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "prune.py"


def test_a_small_history_is_counted_and_pruned_keeping_the_pins(tmp_path):
    res = subprocess.run([sys.executable, str(BENCH), "--plans", "250", "--ranks-per-deployment", "5",
                          "--batch-size", "100", "--json"], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (row,) = [json.loads(line) for line in res.stdout.splitlines()]     # SQLite only: no PostgreSQL URL given
    assert (row["db"], row["plans"], row["kept_pinned"], row["pruned"], row["batches"]) == ("sqlite", 250, 50, 200, 2)
    assert row["dry_run_s"] >= 0 and row["prune_s"] > 0
