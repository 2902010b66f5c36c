"""Helpers of the fault tests: a `loadplan serve` process, health probes, requests, and
the SQL audit that says whether anything was half-written."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import grpc
import sqlalchemy as sa
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadplan.plan import ROLE_SPECULATIVE, ROLE_TARGET, Parallel, ResolveRequest, Runtime
from loadplan.service.rules.resolve import resolve_decisions

SERVICE = "loadplan.v1.ModelRegistry"

# A DeepSeek-V3 shaped target (61 layers, 256 routed experts) and its NextN draft.
TARGET_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "hidden_size": 7168,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "routed_scaling_factor": 2.5,
}
DRAFT_CONFIG = dict(TARGET_CONFIG, architectures=["DeepseekV3ForCausalLMNextN"], num_nextn_predict_layers=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(address: str, timeout: float = 1.0) -> str:
    """SERVING / NOT_SERVING / DOWN (no answer)."""
    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                                        timeout=timeout)
        except grpc.RpcError:
            return "DOWN"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition") -> float:
    """Poll until `predicate()` is true; return the seconds it took; AssertionError after `timeout`."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not reached within {timeout:g}s")
        time.sleep(interval)


class ServeProcess:
    """`loadplan serve --db URL --listen 127.0.0.1:PORT` as a child process (killable, restartable)."""

    def __init__(self, db_url: str, port: int | None = None, *, workers: int = 16):
        self.db_url = db_url
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.workers = workers
        self.proc: subprocess.Popen | None = None
        self.logs: list[str] = []

    def start(self, timeout: float = 30.0) -> "ServeProcess":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loadplan.cli.main", "serve", "--db", self.db_url, "--listen", self.address,
             "--workers", str(self.workers)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: self.proc.poll() is not None or health(self.address, 0.5) == "SERVING", timeout,
                     interval=0.1, what=f"registry on {self.address} SERVING")
        except AssertionError:
            self.kill()
            raise
        if self.proc.poll() is not None:
            raise AssertionError(f"registry exited with {self.proc.returncode}: {self._stderr()}")
        return self

    def kill(self) -> None:
        """SIGKILL: no drain, no clean-up, as when the host dies."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)
            self.logs.append(self._stderr())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr and not self.proc.stderr.closed:
            self.logs.append(self._stderr())

    def _stderr(self) -> str:
        try:
            return self.proc.stderr.read()[-4000:] if self.proc and self.proc.stderr else ""
        except (OSError, ValueError):
            return ""

    def __enter__(self) -> "ServeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --- requests ----------------------------------------------------------------------

def runner_request(request_id: str, deployment_id: str, rank: int, *, role: str = ROLE_TARGET,
                   ranks: int = 32, host: str = "") -> ResolveRequest:
    """Rank `rank` of a deployment of `ranks` processes. Target: pp=4 stages when the
    fleet allows it, experts over the rest; the NextN draft (one layer): experts over all."""
    if role == ROLE_TARGET:
        pp = 4 if ranks % 4 == 0 and ranks >= 4 else 1
        ep = ranks // pp
        parallel = Parallel(ep_size=ep, ep_rank=rank % ep, pp_size=pp, pp_rank=rank // ep)
        config = TARGET_CONFIG
    else:
        parallel = Parallel(ep_size=ranks, ep_rank=rank)
        config = DRAFT_CONFIG
    return ResolveRequest(request_id=request_id, deployment_id=deployment_id, role=role, parallel=parallel,
                          host=host or f"node-{rank // 8}", config=config, runtime=Runtime(a2a_backend="deepep"))


def decision_keys(role: str = ROLE_TARGET) -> frozenset[str]:
    """The keys every resolved plan of this fleet carries (asked of the rules, not copied)."""
    return frozenset(resolve_decisions(runner_request("probe", "probe", 0, role=role)).decisions)


class Outcomes:
    """What concurrent ranks got back, by request id: `received` plans, or `errors` (the test asserts none)."""

    def __init__(self):
        self.received: dict[str, object] = {}
        self.errors: dict[str, BaseException] = {}
        self.lock = threading.Lock()

    def resolve(self, client, req: ResolveRequest) -> None:
        try:
            plan = client.resolve_load_plan(req)
        except BaseException as e:  # noqa: BLE001 - asserted by the test, with the request id
            with self.lock:
                self.errors[req.request_id] = e
            return
        with self.lock:
            self.received[req.request_id] = plan


ROLES = (ROLE_TARGET, ROLE_SPECULATIVE)


# --- the audit ----------------------------------------------------------------------

@dataclass
class Stored:
    """What the database holds, by request id."""

    plan_of_request: dict[str, str]                     # request_id -> plan_id
    decisions: dict[str, dict[str, object]]             # plan_id -> {key: value} (revision 0)
    deployment_of: dict[str, tuple[str, str]]           # plan_id -> (deployment, role)
    pins: dict[tuple[str, str], str]                    # (deployment, role) -> plan_id
    request_counts: dict[str, int]                      # request_id -> number of plans


def read_stored(engine, deployment_prefix: str = "") -> Stored:
    like = f"{deployment_prefix}%"
    with engine.connect() as c:
        plans = c.execute(sa.text("SELECT plan_id, request_id, deployment_id, role, decisions_json FROM plans "
                                  "WHERE deployment_id LIKE :p"), {"p": like}).all()
        decs = c.execute(sa.text("SELECT d.plan_id, d.key, d.value_json FROM decisions d JOIN plans p "
                                 "ON p.plan_id = d.plan_id WHERE d.revision = 0 AND p.deployment_id LIKE :p"),
                         {"p": like}).all()
        pins = c.execute(sa.text("SELECT deployment_id, role, plan_id FROM deployment_pins "
                                 "WHERE deployment_id LIKE :p"), {"p": like}).all()
    counts: dict[str, int] = defaultdict(int)
    for p in plans:
        counts[p.request_id] += 1
    decisions: dict[str, dict[str, object]] = defaultdict(dict)
    for p in plans:   # resolved decisions live in the plan row (migration 0002)...
        for key, value, *_ in json.loads(p.decisions_json or "[]"):
            decisions[p.plan_id][key] = value
    for d in decs:    # ...or, for plans written before it, in revision-0 rows

        decisions[d.plan_id][d.key] = json.loads(d.value_json)
    return Stored(plan_of_request={p.request_id: p.plan_id for p in plans}, decisions=dict(decisions),
                  deployment_of={p.plan_id: (p.deployment_id, p.role) for p in plans},
                  pins={(p.deployment_id, p.role): p.plan_id for p in pins}, request_counts=dict(counts))


def audit(engine, expected_keys: Iterable[str] | dict[str, Iterable[str]], deployment_prefix: str = "") -> Stored:
    """Nothing half-written: every plan has all its decisions, every deployment+role that
    has a plan has exactly one pin pointing at one of its own plans, no orphans.
    `expected_keys`: the decision keys of a plan, or {role: keys}."""
    stored = read_stored(engine, deployment_prefix)
    problems = []
    for request_id, n in stored.request_counts.items():
        if n != 1:
            problems.append(f"request {request_id}: {n} plans")
    for plan_id, (dep, role) in stored.deployment_of.items():
        want = set(expected_keys[role] if isinstance(expected_keys, dict) else expected_keys)
        have = set(stored.decisions.get(plan_id, {}))
        if have != want:
            problems.append(f"plan {plan_id} ({dep}/{role}): decisions {sorted(have)} != {sorted(want)}")
        if (dep, role) not in stored.pins:
            problems.append(f"plan {plan_id}: deployment {dep}/{role} has no pin")
    for (dep, role), plan_id in stored.pins.items():
        if stored.deployment_of.get(plan_id) != (dep, role):
            problems.append(f"pin {dep}/{role} points at {plan_id}, not one of its plans")
    with engine.connect() as c:
        orphans = c.execute(sa.text("SELECT count(*) FROM decisions d LEFT JOIN plans p ON p.plan_id = d.plan_id "
                                    "WHERE p.plan_id IS NULL")).scalar_one()
    if orphans:
        problems.append(f"{orphans} decisions without a plan")
    assert not problems, "half-written or inconsistent rows:\n" + "\n".join(problems[:20])
    return stored


def deployment_wide(plan) -> dict[str, object]:
    """The deployment-wide decisions of a (client-side) LoadPlan: {key: value}."""
    return {k: d.value for k, d in plan.decisions.items() if d.deployment_wide}
