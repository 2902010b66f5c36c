"""PostgreSQL connection cut in the middle of a transaction (issue 6): no half-written plan.

Deterministic windows, not timing luck:
- an engine event hook terminates the registry connection's backend
  (pg_terminate_backend from another connection) right before the k-th statement of
  the save's transaction, for every k, and right before its COMMIT;
- a proxy delivers the COMMIT and swallows the server's answer: the plan is
  committed but the registry (and so the client) never heard it.
Each time: the call fails UNAVAILABLE (or succeeds), a retry with the same request id
gets exactly one plan, and the SQL audit finds every plan with all its decisions and
every pin with its plan.
"""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from fault_helpers import Outcomes, audit, decision_keys, deployment_wide, runner_request, wait_for
from loadplan.client import RegistryClient
from loadplan.client.errors import RegistryCallError
from loadplan.service.server import RegistryServer, ServerOptions
from loadplan.service.store.db import make_engine
from loadplan.service.store.repository import SqlPlanStore

COMMIT = "commit"


class BackendKiller:
    """Arms itself for one transaction: before its statement number `at` (0-based), or
    before its COMMIT, the backend serving that connection is terminated and gone. Watches
    the engine's transactions (the store's only way to the database)."""

    def __init__(self, engine, admin):
        self.admin = admin
        self.at: int | str | None = None
        self.fired = threading.Event()
        self.statements: list[list[str]] = []   # per transaction seen while counting
        self.counting = False
        self._lock = threading.Lock()
        event.listen(engine, "begin", self._begin)
        event.listen(engine, "before_cursor_execute", self._before_execute)
        event.listen(engine, "commit", self._before_commit)

    def arm(self, at: int | str | None) -> None:
        with self._lock:
            self.at = at
            self.fired.clear()

    def _begin(self, conn) -> None:
        # conn.info outlives the transaction (it belongs to the pooled connection): reset it.
        conn.info["fault_statement"] = 0
        conn.info.pop("fault_log", None)
        if self.counting:
            self.statements.append([])
            conn.info["fault_log"] = self.statements[-1]

    def _before_execute(self, conn, cursor, statement, parameters, context, executemany) -> None:
        n = conn.info.get("fault_statement", 0)
        conn.info["fault_statement"] = n + 1
        if "fault_log" in conn.info:
            conn.info["fault_log"].append(_summary(statement))
        self._maybe_kill(lambda: conn.connection.dbapi_connection.info.backend_pid, n)

    def _before_commit(self, conn) -> None:
        if "fault_log" in conn.info:
            conn.info["fault_log"].append(COMMIT)
        self._maybe_kill(lambda: conn.connection.dbapi_connection.info.backend_pid, COMMIT)

    def _maybe_kill(self, backend_pid, where) -> None:
        with self._lock:
            if self.at is None or self.at != where:
                return
            self.at = None
        pid = backend_pid()
        with self.admin.connect() as c:
            assert c.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar_one()
        wait_for(lambda: not self._alive(pid), 5, 0.01, f"backend {pid} gone")
        self.fired.set()

    def _alive(self, pid: int) -> bool:
        with self.admin.connect() as c:
            return bool(c.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"),
                                  {"pid": pid}).scalar_one())


def _summary(statement: str) -> str:
    words = statement.split()
    return words[0] + " " + " ".join(words[1:3])


@pytest.fixture(scope="module")
def admin(pg_db):
    engine = make_engine(pg_db).execution_options(isolation_level="AUTOCOMMIT")
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def killed_registry(pg_db, admin):
    engine = make_engine(pg_db)
    killer = BackendKiller(engine, admin)
    # No readiness polling during the test: its transactions would take the armed slot.
    server = RegistryServer(SqlPlanStore(engine), ServerOptions(listen="127.0.0.1:0", max_workers=4,
                                                                 readiness_interval_s=3600)).start()
    try:
        yield server, killer
    finally:
        server.stop(grace=1)
        engine.dispose()


def _points_of_one_save(server, killer, req) -> list[int | str]:
    """Where saving `req` can be cut: before each of its statements, and before its COMMIT if it
    commits a transaction (an autocommitted statement commits itself). Asked of the store in
    use, not assumed."""
    killer.counting = True
    killer.statements.clear()
    try:
        with RegistryClient(server.address, timeout=10, max_attempts=1) as c:
            c.resolve_load_plan(req)
    finally:
        killer.counting = False
    writes = [t for t in killer.statements if t]   # the readiness poll is off: only the save runs
    assert len(writes) == 1, killer.statements
    n = sum(1 for s in writes[0] if s != COMMIT)
    return [*range(n), *([COMMIT] if COMMIT in writes[0] else [])]


@pytest.mark.parametrize("rank_kind", ["first rank", "later rank"])
def test_backend_terminated_at_every_point_of_a_save(killed_registry, pg_engine, rank_kind):
    """The first rank of a deployment writes its pin; a later one only checks it (the
    store may know it already), so the two saves have different statements."""
    server, killer = killed_registry
    dep = f"cut-{uuid.uuid4().hex[:8]}"
    if rank_kind == "first rank":
        deployment = lambda at: f"{dep}-{at}"   # noqa: E731 - a new deployment per cut point
    else:
        deployment = lambda at: dep             # noqa: E731
        with RegistryClient(server.address, timeout=10) as c:
            c.resolve_load_plan(runner_request(f"{dep}-r0", dep, 0))
    points = _points_of_one_save(server, killer, runner_request(f"{dep}-count", deployment("count"), 1))
    assert points and points[0] == 0
    outcomes = {}
    with RegistryClient(server.address, timeout=10, max_attempts=1) as once, \
            RegistryClient(server.address, timeout=20, max_attempts=20, backoff=0.02, max_backoff=0.2) as patient:
        for rank, at in enumerate(points, start=2):
            rid = f"{dep}-at-{at}"
            req = runner_request(rid, deployment(at), rank)
            killer.arm(at)
            try:
                first = once.resolve_load_plan(req)
            except RegistryCallError as e:
                assert e.code == "UNAVAILABLE", f"cut before {at}: {e}"
                first = None
            assert killer.fired.is_set(), f"the save never reached point {at}"
            # The retry (same request id) gets the one plan; a succeeded first call is replayed.
            second = patient.resolve_load_plan(req)
            if first is not None:
                assert second.replayed and second.plan_id == first.plan_id
            outcomes[at] = "ok" if first else "UNAVAILABLE"
            stored = audit(pg_engine, decision_keys(), deployment_prefix=dep)
            assert stored.request_counts[rid] == 1
            assert stored.plan_of_request[rid] == second.plan_id
            assert stored.decisions[second.plan_id] == {k: d.value for k, d in second.decisions.items()}
    print(f"{rank_kind}: cut points {points}; outcome per cut point: {outcomes}")
    stored = audit(pg_engine, decision_keys(), deployment_prefix=dep)
    assert len(stored.pins) == len({deployment(at) for at in ["count", *points]} | (
        {dep} if rank_kind == "later rank" else set()))


def test_commit_answer_lost_then_retry_replays(pg_proxy, pg_engine):
    """The COMMIT of a plan's transaction reached PostgreSQL, its answer never came back: the
    plan exists, the client heard UNAVAILABLE; its retry must get that very plan (replayed),
    not a second one."""
    proxy, url = pg_proxy
    engine = make_engine(url)   # as `loadplan serve` makes it
    server = RegistryServer(SqlPlanStore(engine), ServerOptions(listen="127.0.0.1:0", max_workers=4,
                                                                 readiness_interval_s=3600)).start()
    dep = f"lost-{uuid.uuid4().hex[:8]}"
    try:
        with RegistryClient(server.address, timeout=10, max_attempts=1) as once:
            once.resolve_load_plan(runner_request(f"{dep}-warm", dep, 0))   # warm the pool
            req = runner_request(f"{dep}-r1", dep, 1)
            proxy.lose_reply_to(b"COMMIT")   # the next COMMIT is this save's (readiness polls are off)
            with pytest.raises(RegistryCallError) as info:
                once.resolve_load_plan(req)
            assert info.value.code == "UNAVAILABLE", info.value
            assert proxy.ambushed.is_set()
            committed = audit(pg_engine, decision_keys(), deployment_prefix=dep)
            assert committed.request_counts.get(req.request_id) == 1, "the ambushed COMMIT did not land"
            retry = once.resolve_load_plan(req)
        assert retry.replayed
        assert retry.plan_id == committed.plan_of_request[req.request_id]
    finally:
        server.stop(grace=1)
        engine.dispose()
    stored = audit(pg_engine, decision_keys(), deployment_prefix=dep)
    assert stored.request_counts == {f"{dep}-warm": 1, f"{dep}-r1": 1}


def test_cuts_while_many_ranks_save_at_once(pg_proxy, pg_engine, admin):
    """Concurrent saves share transactions (group commit): a backend terminated in the middle,
    or a COMMIT whose answer is lost, hits several callers at once. Every rank still ends
    with exactly one plan, the one on disk, and the ranks of a deployment agree."""
    proxy, url = pg_proxy
    engine = make_engine(url)
    killer = BackendKiller(engine, admin)
    server = RegistryServer(SqlPlanStore(engine), ServerOptions(listen="127.0.0.1:0", max_workers=16,
                                                                 readiness_interval_s=3600)).start()
    dep = f"many-{uuid.uuid4().hex[:6]}"
    deployments = [f"{dep}-a", f"{dep}-b"]
    outcomes = Outcomes()
    received, errors = outcomes.received, outcomes.errors
    stop = threading.Event()
    fired = []

    def chaos():
        # A save is a transaction (look-ups, inserts, COMMIT) of one or several plans: a backend
        # killed before its first statement, or a statement's reply lost, hits every plan in it.
        faults = [0, "lose a save's reply", 0, "lose a save's reply", 0]
        for fault in faults:
            if stop.is_set():
                return
            if fault == "lose a save's reply":
                proxy.lose_reply_to(dep.encode())   # in every save's parameters (its deployment)
                hit = proxy.ambushed
            else:
                killer.arm(fault)
                hit = killer.fired
            while not hit.wait(0.05):
                if stop.is_set():
                    killer.arm(None)
                    return
            fired.append(fault)

    def rank(client, d, r):
        req = runner_request(f"{d}-rank{r}", d, r)
        time.sleep(random.Random(r).uniform(0, 1.5))   # ranks come up over a second and a half
        outcomes.resolve(client, req)

    clients = [RegistryClient(server.address, timeout=40, max_attempts=100, backoff=0.02, max_backoff=0.3)
               for _ in range(4)]
    threads = [threading.Thread(target=rank, args=(clients[r % 4], d, r)) for d in deployments for r in range(32)]
    monkey = threading.Thread(target=chaos)
    try:
        monkey.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=45)
    finally:
        stop.set()
        monkey.join(timeout=5)
        for c in clients:
            c.close()
        server.stop(grace=1)
        engine.dispose()
    print(f"faults that hit a save: {fired}")
    assert len(fired) >= 3, f"too few faults hit a save to mean anything: {fired}"
    assert not errors, {k: repr(v) for k, v in list(errors.items())[:5]}
    assert len(received) == 64
    stored = audit(pg_engine, decision_keys(), deployment_prefix=dep)
    assert {rid: p.plan_id for rid, p in received.items()} == stored.plan_of_request
    for rid, p in received.items():
        assert stored.decisions[p.plan_id] == {k: d.value for k, d in p.decisions.items()}, rid
    for d in deployments:
        wide = [deployment_wide(p) for p in received.values() if p.request.deployment_id == d]
        assert len(wide) == 32 and all(w == wide[0] for w in wide), f"ranks of {d} disagree"
    assert sorted(stored.pins) == sorted((d, "target") for d in deployments)
