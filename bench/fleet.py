"""Fleet start: every rank of a fleet asks for its plan at once, each over a fresh connection.

    python bench/fleet.py [--postgres-url URL] [--replicas 2] [--deployments 8] [--ranks 128] [--rounds 3]
                          [--registry HOST:PORT ...]

The budget shape of issue 29. 8 deployments x 128 ranks x 2 roles (a DeepSeek-V3 target on ep=32 x pp=4,
and its NextN draft on ep=128) = 2048 ranks. Each rank opens its own channel (a worker process connecting
for the first time), the ranks are released together, and each sends one ResolveLoadPlan with its own
request id (retrying UNAVAILABLE with the same request, as the client does), spread round-robin over
`--replicas` registry processes (`loadplan serve`) on one fresh, migrated PostgreSQL database
(--postgres-url or LOADPLAN_TEST_POSTGRES_URL; dropped afterwards), or over the `--registry` addresses.

Beside it, the same number of Echo calls of the same shape (a fresh channel each, released together,
spread over the same replicas, the payload as large as a resolve's request), in alternating rounds
(`--rounds` pairs, the order swapped each round) so a machine whose speed drifts slows both alike.

Prints one JSON line per measurement: `method` (resolve | echo), `round`, `calls`, `last_s` (release to
the last answer), `p50_ms`, `p99_ms` (per call, connection set-up included), `errors` (calls that failed
after their retries), `retries`, and for resolves `agree` (every deployment+role's ranks got the same
deployment-wide decisions). Then a `summary` line: median last_s of each, `last_vs_echo` (their ratio),
and the budget (last plan <= 1.5x echo's, no error, every deployment agrees) as `target_met`.
tests/faults/test_fleet_start.py runs `run_fleet` (one shared channel) against one replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

import grpc

from loadplan.client import convert
from loadplan.plan import ROLE_SPECULATIVE, ROLE_TARGET, LoadPlan, Parallel, ResolveRequest, Runtime
from loadplan.v1 import registry_pb2 as pb
from loadplan.v1 import registry_pb2_grpc as pb_grpc

TARGET_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "hidden_size": 7168,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "routed_scaling_factor": 2.5,
}
DRAFT_CONFIG = dict(TARGET_CONFIG, architectures=["DeepseekV3ForCausalLMNextN"], num_nextn_predict_layers=1)
ROLES = (ROLE_TARGET, ROLE_SPECULATIVE)
BUDGET = 1.5          # issue 29: the last plan arrives at most this many times as late as the last echo


def rank_request(prefix: str, deployment: int, rank: int, role: str, ranks: int) -> ResolveRequest:
    """Rank `rank` of deployment `deployment`: the target on pp=4 stages (experts over the
    rest), the one-layer NextN draft with its experts over all ranks."""
    dep = f"{prefix}-d{deployment}"
    if role == ROLE_TARGET:
        pp = 4 if ranks % 4 == 0 else 1
        ep = ranks // pp
        parallel, config = Parallel(ep_size=ep, ep_rank=rank % ep, pp_size=pp, pp_rank=rank // ep), TARGET_CONFIG
    else:
        parallel, config = Parallel(ep_size=ranks, ep_rank=rank), DRAFT_CONFIG
    return ResolveRequest(request_id=f"{dep}-{role}-r{rank}", deployment_id=dep, role=role, parallel=parallel,
                          host=f"node-{deployment}-{rank // 8}", config=config,
                          runtime=Runtime(a2a_backend="deepep"))


def fleet_requests(prefix: str, deployments: int, ranks: int) -> list[ResolveRequest]:
    reqs = [rank_request(prefix, d, r, role, ranks) for d in range(deployments) for r in range(ranks) for role in ROLES]
    random.Random(0).shuffle(reqs)   # ranks of one deployment do not start in order
    return reqs


def _percentile_ms(latencies: list[float], q: float) -> float:
    lat = sorted(latencies)
    return round(lat[min(len(lat) - 1, int(round(q * (len(lat) - 1))))] * 1e3, 2) if lat else 0.0


def disagreeing(plans: list[LoadPlan]) -> list[tuple[str, str]]:
    """(deployment, role) whose ranks got different deployment-wide decisions."""
    seen: dict[tuple[str, str], set[str]] = {}
    for p in plans:
        wide = json.dumps({k: d.value for k, d in p.decisions.items() if d.deployment_wide}, sort_keys=True)
        seen.setdefault((p.request.deployment_id, p.request.role), set()).add(wide)
    return sorted(k for k, v in seen.items() if len(v) != 1)


@dataclass
class FleetResult:
    resolves: int
    fleet_start_s: float
    latencies_s: list[float]
    retries: int
    plans: list[LoadPlan] = field(repr=False)

    def disagreeing(self) -> list[tuple[str, str]]:
        return disagreeing(self.plans)

    def figures(self) -> dict:
        return {"resolves": self.resolves, "fleet_start_s": round(self.fleet_start_s, 3),
                "throughput_rps": round(self.resolves / self.fleet_start_s, 1),
                "p50_ms": _percentile_ms(self.latencies_s, 0.5), "p99_ms": _percentile_ms(self.latencies_s, 0.99),
                "max_ms": _percentile_ms(self.latencies_s, 1.0), "retries": self.retries,
                "deployment_roles": len({(p.request.deployment_id, p.request.role) for p in self.plans}),
                "all_ranks_agree": not self.disagreeing()}


async def _call_retrying(call, msg, deadline: float) -> tuple[object, int]:
    """`call(msg)`, retried on UNAVAILABLE with the same message (backoff with jitter) until `deadline`."""
    retries, delay = 0, 0.05
    while True:
        try:
            return await call(msg, timeout=max(0.1, deadline - time.monotonic())), retries
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay > deadline:
                raise RuntimeError(f"{e.code().name}: {e.details()}") from None
        retries += 1
        await asyncio.sleep(delay * random.uniform(0.5, 1.0))
        delay = min(delay * 2, 1.0)


async def run_fleet(address: str, requests: list[ResolveRequest], *, inflight: int = 256,
                    timeout_s: float = 120.0) -> FleetResult:
    """Every request over ONE shared channel, at most `inflight` outstanding; raises on any
    status but UNAVAILABLE (retried). What tests/faults/test_fleet_start.py asserts on."""
    sem = asyncio.Semaphore(inflight)
    latencies: list[float] = []
    retries = 0
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ModelRegistryStub(channel)

        async def one(req: ResolveRequest) -> LoadPlan:
            nonlocal retries
            msg = convert.request_to_pb(req)
            async with sem:
                t = time.perf_counter()
                try:
                    reply, n = await _call_retrying(stub.ResolveLoadPlan, msg, deadline)
                except RuntimeError as e:
                    raise RuntimeError(f"{req.request_id}: {e}") from None
                latencies.append(time.perf_counter() - t)
                retries += n
            return convert.plan_from_pb(reply)

        start = time.perf_counter()
        plans = await asyncio.gather(*(one(r) for r in requests))
        took = time.perf_counter() - start
    return FleetResult(len(requests), took, latencies, retries, list(plans))


async def fresh_channels(addresses: list[str], method: str, messages: list, *, timeout_s: float = 120.0) -> dict:
    """Each message from its own fresh channel (to `addresses[i % len]`), all released together.
    Returns the figures of one measurement (see the module's docstring) and the answers."""
    release = asyncio.Event()
    deadline = time.monotonic() + timeout_s
    latencies: list[float] = []
    answers: list = [None] * len(messages)
    errors: list[str] = []
    retries = 0

    async def one(i: int, msg) -> None:
        nonlocal retries
        await release.wait()
        t = time.perf_counter()
        try:
            async with grpc.aio.insecure_channel(addresses[i % len(addresses)]) as channel:
                call = getattr(pb_grpc.ModelRegistryStub(channel), method)
                answers[i], n = await _call_retrying(call, msg, deadline)
                retries += n
        except Exception as e:  # noqa: BLE001 - counted and the first few shown, not raised
            errors.append(str(e))
            return
        latencies.append(time.perf_counter() - t)

    tasks = [asyncio.create_task(one(i, m)) for i, m in enumerate(messages)]
    await asyncio.sleep(0)            # every task waiting on the release
    start = time.perf_counter()
    release.set()
    await asyncio.gather(*tasks)
    last = time.perf_counter() - start
    return {"method": "resolve" if method == "ResolveLoadPlan" else "echo", "calls": len(messages),
            "last_s": round(last, 3), "p50_ms": _percentile_ms(latencies, 0.5),
            "p99_ms": _percentile_ms(latencies, 0.99), "errors": len(errors), "retries": retries,
            "first_errors": errors[:3]}, answers


def measure_round(addresses: list[str], deployments: int, ranks: int, first: str, round_no: int) -> list[dict]:
    """One echo measurement and one fleet start (fresh request ids), `first` of the two first."""
    prefix = f"fleet-{uuid.uuid4().hex[:6]}"
    resolves = [convert.request_to_pb(r) for r in fleet_requests(prefix, deployments, ranks)]
    size = max(len(m.SerializeToString()) for m in resolves)
    echoes = [pb.EchoRequest(payload=os.urandom(size)) for _ in resolves]
    rows = []
    for method in ((first, "echo" if first == "resolve" else "resolve")):
        if method == "resolve":
            row, answers = asyncio.run(fresh_channels(addresses, "ResolveLoadPlan", resolves))
            plans = [convert.plan_from_pb(a) for a in answers if a is not None]
            row["agree"] = len(plans) == len(resolves) and not disagreeing(plans)
        else:
            row, _ = asyncio.run(fresh_channels(addresses, "Echo", echoes))
        row["round"] = round_no
        rows.append(row)
    return rows


# --- the script: registries on a fresh PostgreSQL database -----------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fresh_postgres(url: str):
    import sqlalchemy as sa

    from loadplan.service.store.db import normalize_url

    base = normalize_url(url)
    name = f"loadplan_fleet_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()

    return base.set(database=name).render_as_string(hide_password=False), drop


def _serve(db_url: str) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "loadplan.cli.main", "serve", "--db", db_url, "--listen", address],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, address


def _wait_serving(proc: subprocess.Popen, address: str) -> None:
    from loadplan.service.healthcheck import check

    deadline = time.time() + 60
    while not check(address, timeout=0.5):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"registry did not become SERVING: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.2)


def summary(rows: list[dict]) -> dict:
    def median(method: str, key: str) -> float:
        return round(statistics.median(r[key] for r in rows if r["method"] == method), 3)

    resolve_s, echo_s = median("resolve", "last_s"), median("echo", "last_s")
    errors = sum(r["errors"] for r in rows)
    agree = all(r["agree"] for r in rows if r["method"] == "resolve")
    ratio = round(resolve_s / echo_s, 3) if echo_s else None
    return {"method": "summary", "resolve_last_s": resolve_s, "echo_last_s": echo_s, "last_vs_echo": ratio,
            "resolve_p50_ms": median("resolve", "p50_ms"), "echo_p50_ms": median("echo", "p50_ms"),
            "resolve_p99_ms": median("resolve", "p99_ms"), "echo_p99_ms": median("echo", "p99_ms"),
            "errors": errors, "agree": agree, "target": f"last_vs_echo <= {BUDGET}, no error, agree",
            "target_met": ratio is not None and ratio <= BUDGET and errors == 0 and agree}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--postgres-url", default=os.environ.get("LOADPLAN_TEST_POSTGRES_URL"))
    ap.add_argument("--registry", action="append", metavar="HOST:PORT",
                    help="a running registry (repeat for several replicas); else --replicas are started")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--deployments", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="echo/resolve pairs, the order swapped each round")
    args = ap.parse_args(argv)
    procs: list[subprocess.Popen] = []
    drop = None
    try:
        if args.registry:
            addresses = args.registry
        else:
            if not args.postgres_url:
                raise SystemExit("give --postgres-url (or LOADPLAN_TEST_POSTGRES_URL) or --registry")
            db_url, drop = _fresh_postgres(args.postgres_url)
            subprocess.run([sys.executable, "-m", "loadplan.cli.main", "migrate", "--db", db_url], check=True,
                           stdout=subprocess.DEVNULL)
            started = [_serve(db_url) for _ in range(args.replicas)]
            for proc, address in started:
                procs.append(proc)
                _wait_serving(proc, address)
            addresses = [address for _, address in started]
        rows = []
        for i in range(args.rounds):
            for row in measure_round(addresses, args.deployments, args.ranks, "echo" if i % 2 == 0 else "resolve", i):
                row.update(replicas=len(addresses), deployments=args.deployments, ranks=args.ranks, roles=len(ROLES))
                print(json.dumps(row), flush=True)
                rows.append(row)
        total = summary(rows)
        print(json.dumps(total), flush=True)
        return 0 if total["target_met"] else 1
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if drop is not None:
            drop()


if __name__ == "__main__":
    sys.exit(main())
