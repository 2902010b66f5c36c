"""Registry killed with SIGKILL in the middle of a storm of resolves (issue 6).

256 ranks (8 deployments x 32 ranks) resolve at once through `RegistryClient`, each
with its own request id; once some of them have their plan, the `loadplan serve`
process is SIGKILLed and started again on the same port while the clients keep
retrying. Afterwards:
- every plan a client received is the stored plan of its request id (same id, same
  decisions): nothing a client acted on was lost;
- every request id has exactly one plan; nothing is half-written (SQL audit);
- the ranks of each deployment agree on the deployment-wide decisions, and each
  deployment+role has exactly one pin.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import sqlalchemy as sa

from fault_helpers import Outcomes, ServeProcess, audit, decision_keys, deployment_wide, runner_request
from loadplan.client import RegistryClient

DEPLOYMENTS = 8
RANKS = 32
KILL_AFTER = 24          # plans received before the SIGKILL
STORM_TIMEOUT_S = 45


def test_sigkill_in_the_middle_of_a_storm(pg_db, pg_engine):
    prefix = f"storm-{uuid.uuid4().hex[:6]}"
    deployments = [f"{prefix}-d{i}" for i in range(DEPLOYMENTS)]
    server = ServeProcess(pg_db).start()
    # One client per deployment (its ranks share a channel, as processes of one host would
    # share nothing; either way the request ids are what makes retries safe).
    clients = {d: RegistryClient(server.address, timeout=STORM_TIMEOUT_S, max_attempts=400, backoff=0.05,
                                 max_backoff=0.5) for d in deployments}
    outcomes = Outcomes()
    received, errors, lock = outcomes.received, outcomes.errors, outcomes.lock
    got_some = threading.Event()
    start = threading.Barrier(DEPLOYMENTS * RANKS + 1)

    def rank(dep: str, r: int) -> None:
        req = runner_request(f"{dep}-rank{r}", dep, r, ranks=RANKS)
        start.wait()
        outcomes.resolve(clients[dep], req)
        with lock:
            if len(received) >= KILL_AFTER:
                got_some.set()

    threads = [threading.Thread(target=rank, args=(d, r), daemon=True) for d in deployments for r in range(RANKS)]
    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        start.wait()
        assert got_some.wait(30), f"no {KILL_AFTER} plans before the kill: {len(received)}; errors: {errors}"
        server.kill()
        with lock:
            at_kill = len(received)
        killed_at = time.monotonic() - t0
        server.start()   # same port: the clients' channels find it again
        restarted_at = time.monotonic() - t0
        for t in threads:
            t.join(timeout=max(1.0, STORM_TIMEOUT_S - (time.monotonic() - t0)))
        done_at = time.monotonic() - t0
        # Every rank asks once more with its request id (a worker restarted after the storm):
        # the registry that came back answers each with the plan that rank already holds.
        def again(rid: str, dep: str):
            return rid, clients[dep].resolve_load_plan(runner_request(rid, dep, int(rid.rsplit("rank", 1)[1]),
                                                                      ranks=RANKS))

        with ThreadPoolExecutor(32) as pool:
            replays = dict(pool.map(lambda item: again(item[0], item[1].request.deployment_id),
                                    list(received.items())))
    finally:
        for c in clients.values():
            c.close()
        server.stop()
    print(f"storm: SIGKILL at {killed_at:.2f}s with {at_kill}/{len(threads)} plans received, "
          f"serving again at {restarted_at:.2f}s, all done at {done_at:.2f}s; "
          f"replayed after the restart: {sum(p.replayed for p in received.values())}")
    assert not any(t.is_alive() for t in threads), "ranks still waiting"
    assert not errors, {k: repr(v) for k, v in list(errors.items())[:5]}
    assert at_kill < len(threads), "the storm was over before the kill: nothing tested"
    assert len(received) == DEPLOYMENTS * RANKS

    assert all(r.replayed and r.plan_id == received[rid].plan_id for rid, r in replays.items())
    stored = audit(pg_engine, decision_keys(), deployment_prefix=prefix)
    assert set(stored.plan_of_request) == set(received)
    assert all(n == 1 for n in stored.request_counts.values())
    for request_id, plan in received.items():
        assert stored.plan_of_request[request_id] == plan.plan_id, f"{request_id}: client got a plan not on disk"
        assert stored.decisions[plan.plan_id] == {k: d.value for k, d in plan.decisions.items()}, request_id
    by_deployment = defaultdict(list)
    for plan in received.values():
        by_deployment[plan.request.deployment_id].append(deployment_wide(plan))
    for dep, decisions in by_deployment.items():
        assert all(d == decisions[0] for d in decisions), f"ranks of {dep} disagree"
        assert len(decisions) == RANKS
    assert sorted(stored.pins) == sorted((d, "target") for d in deployments)
    # Rank-specific decisions still follow the rank: 4 pipeline stages, 4 layer ranges.
    ranges = {tuple(p.value("pp.layer_range")) for p in received.values()}
    assert len(ranges) == 4


def test_database_failover_in_the_middle_of_a_storm(pg_db, pg_engine):
    """PostgreSQL drops every connection of the registry at once (a restart or a failover),
    twice, while 256 ranks resolve: the pool reconnects, callers retry, nothing is lost."""
    prefix = f"failover-{uuid.uuid4().hex[:6]}"
    deployments = [f"{prefix}-d{i}" for i in range(DEPLOYMENTS)]
    database = pg_engine.url.database
    admin = pg_engine.execution_options(isolation_level="AUTOCOMMIT")
    outcomes = Outcomes()
    received, errors = outcomes.received, outcomes.errors
    terminated = []
    with ServeProcess(pg_db) as server:
        clients = {d: RegistryClient(server.address, timeout=STORM_TIMEOUT_S, max_attempts=400, backoff=0.05,
                                     max_backoff=0.5) for d in deployments}

        def rank(dep: str, r: int) -> None:
            req = runner_request(f"{dep}-rank{r}", dep, r, ranks=RANKS)
            time.sleep((r % 16) * 0.1)   # ranks come up over 1.6 s, so both failovers land mid-storm
            outcomes.resolve(clients[dep], req)

        threads = [threading.Thread(target=rank, args=(d, r), daemon=True) for d in deployments for r in range(RANKS)]
        try:
            for t in threads:
                t.start()
            for _ in range(2):
                time.sleep(0.5)
                with admin.connect() as c:
                    # Every backend on this database but our own: the registry's whole pool.
                    terminated.append(c.execute(sa.text(
                        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = :db AND pid <> pg_backend_pid() AND backend_type = 'client backend'"),
                        {"db": database}).scalar_one())
            for t in threads:
                t.join(timeout=STORM_TIMEOUT_S)
        finally:
            for c in clients.values():
                c.close()
    print(f"failover: backends terminated {terminated}, plans {len(received)}, "
          f"errors {len(errors)}")
    assert all(n > 0 for n in terminated), f"the failovers hit no registry connection: {terminated}"
    assert not errors, {k: repr(v) for k, v in list(errors.items())[:5]}
    assert len(received) == DEPLOYMENTS * RANKS
    stored = audit(pg_engine, decision_keys(), deployment_prefix=prefix)
    assert {rid: p.plan_id for rid, p in received.items()} == stored.plan_of_request
    for dep in deployments:
        wide = [deployment_wide(p) for p in received.values() if p.request.deployment_id == dep]
        assert all(w == wide[0] for w in wide), f"ranks of {dep} disagree"
    assert sorted(stored.pins) == sorted((d, "target") for d in deployments)
