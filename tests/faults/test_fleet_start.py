"""Fleet start (issue 6, "Load"): 8 deployments x 128 ranks x 2 roles = 2048 resolves at
once against ONE registry (`loadplan serve`) on PostgreSQL, 256 in flight.

All ranks of each deployment+role agree on the deployment-wide decisions, rank-specific
ones follow the rank, exactly 16 pins, every plan on disk. The time to the last plan is
printed as `fleet_start_s=...` (pytest -s); bench/fleet.py is the same run as a script.
"""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib
import sys
import uuid

from fault_helpers import ServeProcess, audit
from loadplan.plan import ROLE_SPECULATIVE, ROLE_TARGET
from loadplan.service.rules.resolve import resolve_decisions

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "fleet.py"
DEPLOYMENTS, RANKS, INFLIGHT = 8, 128, 256


def _bench():
    spec = importlib.util.spec_from_file_location("loadplan_bench_fleet", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_fleet_start(pg_db, pg_engine):
    fleet = _bench()
    prefix = f"fleet-{uuid.uuid4().hex[:6]}"
    requests = fleet.fleet_requests(prefix, DEPLOYMENTS, RANKS)
    assert len(requests) == DEPLOYMENTS * RANKS * 2
    with ServeProcess(pg_db) as server:
        result = asyncio.run(fleet.run_fleet(server.address, requests, inflight=INFLIGHT, timeout_s=90))
    figures = result.figures()
    print(f"\nfleet_start_s={figures['fleet_start_s']}")
    print(f"fleet figures: {figures}")

    assert len(result.plans) == len(requests)
    assert [p.request.request_id for p in result.plans] == [r.request_id for r in requests]
    assert not result.disagreeing(), result.disagreeing()
    assert figures["deployment_roles"] == DEPLOYMENTS * 2

    # Rank-specific decisions follow the rank: the 4 target stages own 4 different layer ranges.
    target_ranges = {tuple(p.value("pp.layer_range")) for p in result.plans if p.request.role == ROLE_TARGET}
    assert len(target_ranges) == 4

    keys = {role: frozenset(resolve_decisions(fleet.rank_request("k", 0, 0, role, RANKS)).decisions)
            for role in (ROLE_TARGET, ROLE_SPECULATIVE)}
    stored = audit(pg_engine, keys, deployment_prefix=prefix)
    assert len(stored.pins) == DEPLOYMENTS * 2
    assert {p.request.request_id: p.plan_id for p in result.plans} == stored.plan_of_request
