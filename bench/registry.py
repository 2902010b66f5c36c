"""Registry throughput and latency: a bare echo RPC vs ResolveLoadPlan with durable writes.

    python bench/registry.py [--postgres-url URL] [--json] [--requests N] [--rounds N] [--ranks-per-deployment N]
                             [--inflight N]

For each database (SQLite file; PostgreSQL when --postgres-url or
LOADPLAN_TEST_POSTGRES_URL is given) it starts one registry server process
(`loadplan serve`) on a fresh, migrated database and measures, on the same
server, Echo and ResolveLoadPlan sequentially (1 in flight) and with 64 in
flight (`--inflight N`: N instead). Every resolve has its own request id, so each one validates, decides and
commits a new plan (no replay is measured). By default every resolve also has its
own deployment id, so each one pins a new deployment too: no pinned-deployment
shortcut. With `--ranks-per-deployment N` consecutive requests are the N ranks of
one deployment (EP N), as workers come up in a fleet: the first pins it, the
others are checked against the pin; rows then carry `ranks_per_deployment`.
Echo and resolve run in `--rounds` adjacent pairs, the order swapped each round,
so a machine whose speed drifts slows both alike; qps are medians over the rounds
and `resolve_vs_echo_qps` is the median of each round's own ratio (each round's is listed too:
`resolve_vs_echo_qps_rounds`). The load
generator is a separate process (this one) using grpc.aio; it serializes requests
before and parses answers after the timed window, and holds its garbage collection
until after it (for both methods alike), since it shares the CPUs with the server.

It also measures `commit_p50_ms`: the p50 of a bare single-row INSERT + COMMIT on
the same database, the floor a durable resolve cannot beat. Each row then says its
target and whether it is met (`target`, `target_met`): with 64 in flight
resolve_vs_echo_qps >= 0.5 (issue 29; the 0.8 of issue 6 is retired); sequentially resolve_p50_ms <= echo_p50_ms +
commit_p50_ms + 0.25 (other loads have none: `-`, null).

And the CPU each call costs, over the timed windows (Linux, from /proc): the
server process's (`*_server_cpu_ms`), this load generator's (`*_client_cpu_ms`)
and, for a PostgreSQL on this machine, its processes' (`*_db_cpu_ms`; None for a
remote one; 0 for SQLite, which runs in the server's process), with
`*_busy_cores`, the machine's CPUs in use meanwhile. Two ratios follow from them:
`server_cpu_bound`, echo's server CPU over resolve's, is the resolve/echo ratio of
a server whose one event loop is the bottleneck for both; `cpu_bound`, the same for
server, client and database together, is the ratio of a machine whose CPUs are all
busy for both. On a machine this small, resolve_vs_echo_qps stays below both.

Prints one JSON object per (db, inflight) with --json, else a table.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import grpc

from loadplan.client import convert
from loadplan.plan import Parallel, ResolveRequest, Runtime
from loadplan.v1 import registry_pb2 as pb

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "hidden_size": 7168,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_cpu_s(pids: list[int]) -> float | None:
    """utime + stime of `pids` in seconds, from /proc (None where there is no /proc)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:      # a process that ended meanwhile (a PostgreSQL backend)
            continue
        except OSError:
            return None
        total += int(fields[11]) + int(fields[12])
    return total / _clock_ticks()


def _postgres_pids() -> list[int]:
    """The PostgreSQL server processes of this machine that /proc shows ([] elsewhere)."""
    pids = []
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            if entry.joinpath("comm").read_text().strip() in ("postgres", "postmaster"):
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def _busy_ticks() -> tuple[int, int] | None:
    """(busy, all) CPU ticks of the machine since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)      # idle and iowait are not busy


def _local_postgres(url: str) -> bool:
    """Whether the database of `url` is a PostgreSQL on this machine (its processes can be measured)."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    return u.get_backend_name() == "postgresql" and (u.host or "localhost") in ("localhost", "127.0.0.1", "::1")


class CpuMeter:
    """CPU spent by the server, this process and the database over the windows it brackets. `database`:
    "in-server" (SQLite), "local" (PostgreSQL processes of this machine) or "remote" (not measured)."""

    def __init__(self, server_pid: int, database: str):
        self.server_pid = server_pid
        self.database = database
        self.spent: dict[str, float | None] = {"server": 0.0, "client": 0.0,
                                               "db": None if database == "remote" else 0.0}
        self.busy = [0, 0]

    def _others(self) -> tuple:
        """(server, database, machine) readings; the database's walks /proc, which costs this process CPU."""
        db = _process_cpu_s(_postgres_pids()) if self.database == "local" else 0.0
        return _process_cpu_s([self.server_pid]), db, _busy_ticks()

    def start(self) -> tuple:
        others = self._others()
        return time.process_time(), *others          # this process's clock last: the walk is not counted

    def stop(self, before: tuple) -> None:
        after = (time.process_time(), *self._others())  # ... and first
        for name, a, b in zip(("client", "server", "db"), before, after):
            if self.spent[name] is not None:
                self.spent[name] = None if a is None or b is None else self.spent[name] + b - a
        if before[3] and after[3]:
            self.busy[0] += after[3][0] - before[3][0]
            self.busy[1] += after[3][1] - before[3][1]

    def per_call_ms(self, calls: int) -> dict[str, float | None]:
        return {name: None if v is None else round(v / calls * 1e3, 3) for name, v in self.spent.items()}

    def busy_cores(self) -> float | None:
        return round(self.busy[0] / self.busy[1] * (os.cpu_count() or 1), 2) if self.busy[1] else None


def _fresh_postgres(url: str) -> tuple[str, callable]:
    """Create a uniquely named database next to `url`; return its URL and a drop function."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from loadplan.service.store.db import normalize_url

    base = make_url(normalize_url(url))
    name = f"loadplan_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return base.set(database=name).render_as_string(hide_password=False), drop


def _commit_p50_ms(db_url: str, n: int = 200) -> float:
    """p50 of one durable single-row INSERT + COMMIT, on its own table."""
    from sqlalchemy import text

    from loadplan.service.store.db import make_engine

    engine = make_engine(db_url)
    times = []
    with engine.connect() as c:
        c.execute(text("CREATE TABLE IF NOT EXISTS bench_commit (id VARCHAR(40) PRIMARY KEY, v INTEGER)"))
        c.commit()
        for i in range(n):
            t = time.perf_counter()
            c.execute(text("INSERT INTO bench_commit (id, v) VALUES (:id, :v)"), {"id": uuid.uuid4().hex, "v": i})
            c.commit()
            times.append(time.perf_counter() - t)
        c.execute(text("DROP TABLE bench_commit"))
        c.commit()
    engine.dispose()
    return statistics.median(times) * 1e3


class Server:
    def __init__(self, db_url: str):
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        subprocess.run([sys.executable, "-m", "loadplan.cli.main", "migrate", "--db", db_url], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        self.proc = subprocess.Popen([sys.executable, "-m", "loadplan.cli.main", "serve", "--db", db_url,
                                      "--listen", self.address], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        from loadplan.service.healthcheck import check

        deadline = time.time() + 30
        while not check(self.address, timeout=0.5):
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"registry did not become SERVING: {self.proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _resolve_messages(n: int, ranks_per_deployment: int) -> list[pb.ResolveLoadPlanRequest]:
    """n requests: runs of `ranks_per_deployment` ranks of one deployment (1: a deployment each)."""
    out, deployment = [], ""
    for i in range(n):
        if i % ranks_per_deployment == 0:
            deployment = f"bench-dep-{uuid.uuid4().hex}"
        out.append(_resolve_message(deployment, i % ranks_per_deployment if ranks_per_deployment > 1 else i % 8,
                                    max(8, ranks_per_deployment)))
    return out


def _resolve_message(deployment: str, rank: int, ep_size: int) -> pb.ResolveLoadPlanRequest:
    req = ResolveRequest(request_id=f"bench-{uuid.uuid4().hex}", deployment_id=deployment,
                         parallel=Parallel(ep_size=ep_size, ep_rank=rank), host="bench", config=CONFIG,
                         quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
                         runtime=Runtime())
    return convert.request_to_pb(req)


_METHODS = {"echo": ("/loadplan.v1.ModelRegistry/Echo", pb.EchoResponse),
            "resolve": ("/loadplan.v1.ModelRegistry/ResolveLoadPlan", pb.LoadPlan)}


async def _run(address: str, method: str, n: int, inflight: int,
               ranks_per_deployment: int = 1, meter: CpuMeter | None = None) -> tuple[float, list[float]]:
    """Issue n calls with `inflight` outstanding; return (wall seconds, per-call latencies).

    The load generator shares the machine's CPUs with the server (and the database), so it
    spends as little as it can inside the timed window, the same way for both methods:
    requests are serialized beforehand and the answers are kept as the bytes the server
    sent; after the window every answer is parsed and checked (a plan for its own request)."""
    if method == "echo":
        messages = [pb.EchoRequest(payload=b"x" * 64) for _ in range(n)]
    else:
        messages = _resolve_messages(n, ranks_per_deployment)
    payloads = [m.SerializeToString() for m in messages]
    path, reply_type = _METHODS[method]
    latencies: list[float] = []
    replies: list[bytes | None] = [None] * n
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        queue = iter(range(n))

        async def worker() -> None:
            for i in queue:
                t = time.perf_counter()
                replies[i] = await call(payloads[i], timeout=30)
                latencies.append(time.perf_counter() - t)

        # Nor does it stop for the cyclic garbage collector inside the window (a full collection of
        # this process takes 20-30 ms, a stall of every call in flight): it runs after.
        gc.disable()
        try:
            cpu = meter.start() if meter is not None else None
            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(inflight)))
            wall = time.perf_counter() - start
            if meter is not None:
                meter.stop(cpu)
        finally:
            gc.enable()
    for msg, raw in zip(messages, replies):
        reply = reply_type.FromString(raw)
        if method == "echo":
            assert reply.payload == msg.payload, "echo answered something else"
        else:
            assert reply.plan_id and reply.request_id == msg.request_id and not reply.replayed, \
                "resolve answered something else than a new plan for its request"
    return wall, latencies


def measure(address: str, inflight: int, n: int, ranks_per_deployment: int = 1, rounds: int = 3,
            meters: dict[str, CpuMeter] | None = None) -> dict:
    """Echo and resolve in `rounds` adjacent pairs, the order swapped every round, so a machine
    whose speed drifts (a shared VM) slows both alike: qps are the medians over the rounds,
    `resolve_vs_echo_qps` the median of each round's own ratio (`resolve_vs_echo_qps_rounds`: those ratios),
    latencies over every call.
    `meters` (by method): what the calls cost in CPU, over every round."""
    row: dict = {"inflight": inflight}
    if ranks_per_deployment > 1:
        row["ranks_per_deployment"] = ranks_per_deployment
    qps: dict[str, list[float]] = {"echo": [], "resolve": []}
    lat: dict[str, list[float]] = {"echo": [], "resolve": []}
    for method in qps:
        asyncio.run(_run(address, method, min(50, n), inflight, ranks_per_deployment))  # warm-up
    for r in range(rounds):
        for method in (("echo", "resolve") if r % 2 == 0 else ("resolve", "echo")):
            wall, latencies = asyncio.run(_run(address, method, n, inflight, ranks_per_deployment,
                                               (meters or {}).get(method)))
            qps[method].append(n / wall)
            lat[method] += latencies
    for method in qps:
        row[f"{method}_qps"] = round(statistics.median(qps[method]), 1)
        row[f"{method}_p50_ms"] = round(_percentile(lat[method], 0.50) * 1e3, 3)
        row[f"{method}_p99_ms"] = round(_percentile(lat[method], 0.99) * 1e3, 3)
    ratios = [res / echo for res, echo in zip(qps["resolve"], qps["echo"])]
    row["resolve_vs_echo_qps"] = round(statistics.median(ratios), 3)
    # every round's own ratio: how far apart they lie says how much the median can be trusted on this machine
    row["resolve_vs_echo_qps_rounds"] = [round(r, 3) for r in ratios]
    if meters:
        row.update(cpu_figures(meters, n * rounds))
    return row


def cpu_figures(meters: dict[str, CpuMeter], calls: int) -> dict:
    """Per method: CPU ms per call of the server, the client and the database, and the busy cores;
    then `server_cpu_bound` and `cpu_bound` (see the module's docstring), where measured."""
    row: dict = {}
    per_call = {method: meter.per_call_ms(calls) for method, meter in meters.items()}
    for method, meter in meters.items():
        for part, ms in per_call[method].items():
            row[f"{method}_{part}_cpu_ms"] = ms
        row[f"{method}_busy_cores"] = meter.busy_cores()
    echo, res = per_call["echo"], per_call["resolve"]
    if echo["server"] and res["server"]:
        row["server_cpu_bound"] = round(echo["server"] / res["server"], 3)
    if None not in (*echo.values(), *res.values()) and sum(res.values()):
        row["cpu_bound"] = round(sum(echo.values()) / sum(res.values()), 3)
    return row


# The targets for ResolveLoadPlan on PostgreSQL, checked on every row (SQLite's too, for comparison).
QPS_TARGET = 0.5            # at 64 in flight: resolve qps >= 0.5x echo qps (issue 29)
SEQUENTIAL_SLACK_MS = 0.25  # sequentially: resolve p50 <= echo p50 + commit p50 + 0.25 ms


def target_figures(row: dict) -> dict:
    """The row's target and whether it is met: `target` says it in words (with the sequential
    bound computed from the row's own echo and commit p50), `target_met` is True or False."""
    if row["inflight"] == 1:
        bound = row["echo_p50_ms"] + row["commit_p50_ms"] + SEQUENTIAL_SLACK_MS
        return {"target": f"p50<={bound:.3f}", "target_met": row["resolve_p50_ms"] <= bound}
    if row["inflight"] == 64:
        return {"target": f"qps>={QPS_TARGET}x", "target_met": row["resolve_vs_echo_qps"] >= QPS_TARGET}
    return {"target": "-", "target_met": None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--postgres-url", default=os.environ.get("LOADPLAN_TEST_POSTGRES_URL"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=1000, help="calls per concurrent measurement")
    ap.add_argument("--sequential-requests", type=int, default=300, help="calls per sequential measurement")
    ap.add_argument("--rounds", type=int, default=3, help="adjacent echo/resolve pairs per measurement")
    ap.add_argument("--ranks-per-deployment", type=int, default=1,
                    help="consecutive resolves that are ranks of one deployment (1: each its own deployment)")
    ap.add_argument("--inflight", type=int, default=64, metavar="N",
                    help="calls in flight in the concurrent measurement (default 64, the target's)")
    args = ap.parse_args(argv)
    if args.ranks_per_deployment < 1:
        ap.error(f"--ranks-per-deployment must be >= 1, got {args.ranks_per_deployment}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.inflight < 2:
        ap.error(f"--inflight must be >= 2 (1 is the sequential measurement), got {args.inflight}")

    targets: list[tuple[str, str, callable]] = []
    tmp = tempfile.TemporaryDirectory()
    targets.append(("sqlite", f"sqlite:///{pathlib.Path(tmp.name) / 'bench.db'}", lambda: None))
    if args.postgres_url:
        url, drop = _fresh_postgres(args.postgres_url)
        targets.append(("postgresql", url, drop))

    rows = []
    try:
        for name, url, _ in targets:
            server = Server(url)
            try:
                commit = round(_commit_p50_ms(url), 3)
                for inflight, n in ((1, args.sequential_requests), (args.inflight, args.requests)):
                    where = "in-server" if name == "sqlite" else "local" if _local_postgres(url) else "remote"
                    meters = {method: CpuMeter(server.proc.pid, where) for method in ("echo", "resolve")}
                    row = {"db": name,
                           **measure(server.address, inflight, n, args.ranks_per_deployment, args.rounds, meters),
                           "commit_p50_ms": commit}
                    row.update(target_figures(row))
                    rows.append(row)
                    if args.json:
                        print(json.dumps(row), flush=True)
            finally:
                server.close()
    finally:
        for _, _, drop in targets:
            drop()
        tmp.cleanup()

    if not args.json:
        for cols in (["db", "inflight", "echo_qps", "resolve_qps", "resolve_vs_echo_qps", "echo_p50_ms",
                      "resolve_p50_ms", "echo_p99_ms", "resolve_p99_ms", "commit_p50_ms", "target", "target_met"],
                     ["db", "inflight", "echo_server_cpu_ms", "resolve_server_cpu_ms", "echo_client_cpu_ms",
                      "resolve_client_cpu_ms", "resolve_db_cpu_ms", "echo_busy_cores", "resolve_busy_cores",
                      "server_cpu_bound", "cpu_bound"],
                     ["db", "inflight", "resolve_vs_echo_qps", "resolve_vs_echo_qps_rounds"]):
            width = max(14, *(len(c) for c in cols[2:]))
            print("  ".join(f"{c:>{width}}" for c in cols))
            for r in rows:
                print("  ".join(f"{r.get(c)!s:>{width}}" for c in cols))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
