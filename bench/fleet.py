"""Fleet start: every rank of a fleet asks for its plan at once, against ONE registry.

    python bench/fleet.py [--postgres-url URL] [--registry HOST:PORT] [--deployments 8] [--ranks 128]
                          [--inflight 256]

8 deployments x 128 ranks x 2 roles (a DeepSeek-V3 target on ep=32 x pp=4, and its
NextN draft on ep=128) = 2048 resolves, each with its own request id, at most
`--inflight` at a time (grpc.aio, one channel), retrying UNAVAILABLE with the same
request as the client does. Without --registry it starts `loadplan serve` on a fresh,
migrated PostgreSQL database (--postgres-url or LOADPLAN_TEST_POSTGRES_URL) and drops
it afterwards.

Prints one JSON object: fleet_start_s (first request sent to last plan received),
throughput, per-resolve latency percentiles, retries, whether the ranks of every
deployment+role agree on the deployment-wide decisions, and (when it owns the
database) the number of deployment pins. tests/faults/test_fleet_start.py runs the
same `run_fleet` and asserts on its answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

import grpc

from loadplan.client import convert
from loadplan.plan import ROLE_SPECULATIVE, ROLE_TARGET, LoadPlan, Parallel, ResolveRequest, Runtime
from loadplan.v1 import registry_pb2_grpc as pb_grpc

TARGET_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "hidden_size": 7168,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "routed_scaling_factor": 2.5,
}
DRAFT_CONFIG = dict(TARGET_CONFIG, architectures=["DeepseekV3ForCausalLMNextN"], num_nextn_predict_layers=1)
ROLES = (ROLE_TARGET, ROLE_SPECULATIVE)


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


@dataclass
class FleetResult:
    resolves: int
    fleet_start_s: float
    latencies_s: list[float]
    retries: int
    plans: list[LoadPlan] = field(repr=False)

    def disagreeing(self) -> list[tuple[str, str]]:
        """(deployment, role) whose ranks got different deployment-wide decisions."""
        seen: dict[tuple[str, str], set[str]] = {}
        for p in self.plans:
            wide = json.dumps({k: d.value for k, d in p.decisions.items() if d.deployment_wide}, sort_keys=True)
            seen.setdefault((p.request.deployment_id, p.request.role), set()).add(wide)
        return sorted(k for k, v in seen.items() if len(v) != 1)

    def figures(self) -> dict:
        lat = sorted(self.latencies_s)

        def pct(q: float) -> float:
            return round(lat[min(len(lat) - 1, int(round(q * (len(lat) - 1))))] * 1e3, 2)

        return {"resolves": self.resolves, "fleet_start_s": round(self.fleet_start_s, 3),
                "throughput_rps": round(self.resolves / self.fleet_start_s, 1),
                "p50_ms": pct(0.5), "p99_ms": pct(0.99), "max_ms": pct(1.0), "retries": self.retries,
                "deployment_roles": len({(p.request.deployment_id, p.request.role) for p in self.plans}),
                "all_ranks_agree": not self.disagreeing()}


async def run_fleet(address: str, requests: list[ResolveRequest], *, inflight: int = 256,
                    timeout_s: float = 120.0) -> FleetResult:
    """Send every request at once (at most `inflight` outstanding); each retries UNAVAILABLE
    with the same message until `timeout_s`. Raises on any other status."""
    sem = asyncio.Semaphore(inflight)
    retries = 0
    latencies: list[float] = []
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ModelRegistryStub(channel)

        async def one(req: ResolveRequest) -> LoadPlan:
            nonlocal retries
            msg = convert.request_to_pb(req)
            async with sem:
                t = time.perf_counter()
                delay = 0.05
                while True:
                    try:
                        reply = await stub.ResolveLoadPlan(msg, timeout=max(0.1, deadline - time.monotonic()))
                        break
                    except grpc.aio.AioRpcError as e:
                        if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay > deadline:
                            raise RuntimeError(f"{req.request_id}: {e.code().name}: {e.details()}") from None
                    retries += 1
                    await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                    delay = min(delay * 2, 1.0)
                latencies.append(time.perf_counter() - t)
            return convert.plan_from_pb(reply)

        start = time.perf_counter()
        plans = await asyncio.gather(*(one(r) for r in requests))
        took = time.perf_counter() - start
    return FleetResult(len(requests), took, latencies, retries, list(plans))


# --- the script: a registry on a fresh PostgreSQL database -----------------------------

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


def _count_pins(db_url: str) -> int:
    from loadplan.service.store.db import make_engine

    engine = make_engine(db_url)
    try:
        with engine.connect() as c:
            return c.exec_driver_sql("SELECT count(*) FROM deployment_pins").scalar_one()
    finally:
        engine.dispose()


def _serve(db_url: str) -> tuple[subprocess.Popen, str]:
    from loadplan.service.healthcheck import check

    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    subprocess.run([sys.executable, "-m", "loadplan.cli.main", "migrate", "--db", db_url], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    proc = subprocess.Popen([sys.executable, "-m", "loadplan.cli.main", "serve", "--db", db_url, "--listen", address],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 30
    while not check(address, timeout=0.5):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"registry did not become SERVING: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.2)
    return proc, address


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--postgres-url", default=os.environ.get("LOADPLAN_TEST_POSTGRES_URL"))
    ap.add_argument("--registry", help="HOST:PORT of a running registry (else one is started)")
    ap.add_argument("--deployments", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=128)
    ap.add_argument("--inflight", type=int, default=256)
    args = ap.parse_args(argv)
    prefix = f"fleet-{uuid.uuid4().hex[:6]}"
    reqs = fleet_requests(prefix, args.deployments, args.ranks)
    proc = drop = db_url = None
    try:
        if args.registry:
            address = args.registry
        else:
            if not args.postgres_url:
                raise SystemExit("give --postgres-url (or LOADPLAN_TEST_POSTGRES_URL) or --registry")
            db_url, drop = _fresh_postgres(args.postgres_url)
            proc, address = _serve(db_url)
        result = asyncio.run(run_fleet(address, reqs, inflight=args.inflight))
        figures = {"deployments": args.deployments, "ranks": args.ranks, "roles": len(ROLES),
                   "inflight": args.inflight, **result.figures()}
        if db_url:
            figures["pins"] = _count_pins(db_url)
        print(json.dumps(figures))
        return 0 if figures["all_ranks_agree"] else 1
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if drop is not None:
            drop()


if __name__ == "__main__":
    sys.exit(main())
