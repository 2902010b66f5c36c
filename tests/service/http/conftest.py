"""A registry with a history to look at: a real server on SQLite with its HTTP side.

One module-scoped registry per test module (a start costs ~1 s): deployment `dsv3-ep2`
(DeepSeek-V3, two EP ranks, each with a draft of its own that does not fuse), deployment
`qwen-one` (one Qwen3 rank), EPLB rebalances appended to the first rank's plan, and the oldest, `qwen-fuseep`, an
SGLang 0.5.22 deployment, and before it `dsv3-observed`, an observed plan of SGLang 0.5.19 (no profile).
"""

from __future__ import annotations

import pathlib
import sys
from dataclasses import dataclass

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from sample_requests import deepseek_config, real_config, request  # noqa: E402

from loadplan.client import RegistryClient  # noqa: E402
from loadplan.plan import Decision, Keys, LoadPlan, Parallel, Runtime  # noqa: E402
from loadplan.service.auth import TokenStore, parse_entries  # noqa: E402
from loadplan.service.http.app import create_app  # noqa: E402
from loadplan.service.http.server import HttpServer  # noqa: E402
from loadplan.service.metrics import RegistryMetrics, ResolveMetrics  # noqa: E402
from loadplan.service.registry import Registry  # noqa: E402
from loadplan.service.server import RegistryServer, ServerOptions  # noqa: E402
from loadplan.service.store.db import make_engine, migrate  # noqa: E402
from loadplan.service.store.repository import SqlPlanStore  # noqa: E402

from web_tokens import READER_TOKEN, WORKER_TOKEN  # noqa: E402


@dataclass
class History:
    base: str                       # the web view's http://host:port
    grpc: str
    metrics: RegistryMetrics
    targets: list[LoadPlan]
    drafts: list[LoadPlan]
    qwen: LoadPlan
    rebalanced: LoadPlan            # targets[0] after its rebalances


@dataclass
class Guarded:
    base: str
    grpc: str
    plan: LoadPlan                  # resolved by the worker


def _fill(client: RegistryClient) -> tuple[list[LoadPlan], list[LoadPlan], LoadPlan, LoadPlan]:
    # An observed plan of SGLang 0.5.19, a release without a profile, the oldest here; then an SGLang 0.5.22
    # deployment whose forward path 0.5.23 changes (the upgrade-check page).
    client.record_observed_plan(request(real_config("deepseek-v3"), deployment_id="dsv3-observed",
                                        parallel=Parallel(tp_size=8), runtime=Runtime(
                                            device="cuda:9.0", engine="sglang", engine_version="0.5.19")),
                                [Decision(Keys.SHARED_EXPERTS_FUSION, True, "SGLang 0.5.19 decided", "adapter"),
                                 Decision(Keys.NUM_FUSED_SHARED_EXPERTS, 1, "its model's count", "adapter")])
    client.resolve_load_plan(request(real_config("qwen1.5-moe-a2.7b"), deployment_id="qwen-fuseep",
                                     parallel=Parallel(tp_size=8), runtime=Runtime(
                                         a2a_backend="ascend_fuseep", device="cuda:10.0", engine="sglang",
                                         engine_version="0.5.22", disable_shared_experts_fusion=True)))
    runtime = Runtime(a2a_backend="deepep", enable_eplb=True, ep_num_redundant_experts=2)
    targets, drafts = [], []
    for rank in range(2):
        par = Parallel(ep_size=2, ep_rank=rank)
        targets.append(client.resolve_load_plan(request(deepseek_config(), deployment_id="dsv3-ep2", parallel=par,
                                                        host=f"node-{rank}", runtime=runtime)))
        drafts.append(client.resolve_load_plan(request(
            deepseek_config(), deployment_id="dsv3-ep2", role="speculative", parallel=par, host=f"node-{rank}",
            runtime=Runtime(a2a_backend="deepep", disable_shared_experts_fusion=True))))
    qwen = client.resolve_load_plan(request(real_config("qwen3-30b-a3b"), deployment_id="qwen-one"))
    # EPLB rebalances every rank of the deployment at once: the ranks still agree.
    for step, placement in enumerate(([[1, 0, 2]], [[2, 1, 0]]), start=1):
        for t in targets:
            client.append_decisions(f"rebalance-{step}-{t.plan_id}", t.plan_id, [Decision(
                Keys.EPLB_PLACEMENT, placement, f"rebalanced after {step * 1000} steps", "eplb.rebalance")])
    rebalanced = client.get_plan(targets[0].plan_id, include_history=True)
    # A deployment whose second rank alone was rebalanced: its ranks disagree.
    split = [client.resolve_load_plan(request(deepseek_config(), deployment_id="split-ep2", runtime=runtime,
                                              parallel=Parallel(ep_size=2, ep_rank=rank))) for rank in range(2)]
    client.append_decisions("rebalance-split", split[1].plan_id, [Decision(
        Keys.EPLB_PLACEMENT, [[0, 2, 1]], "rebalanced after 1000 steps", "eplb.rebalance")])
    return targets, drafts, qwen, rebalanced


def _start(tmp_path_factory, tokens: TokenStore | None):
    path = tmp_path_factory.mktemp("web") / "history.db"
    url = f"sqlite:///{path}"
    migrate(url)
    engine = make_engine(url)
    store = SqlPlanStore(engine)
    metrics = RegistryMetrics()
    server = RegistryServer(store, ServerOptions(listen="127.0.0.1:0", max_workers=4, tokens=tokens,
                                                 interceptors=(ResolveMetrics(metrics),),
                                                 on_commit=metrics.observe_commit)).start()
    metrics.follow(server)
    http = HttpServer(create_app(Registry(store), metrics, tokens), "127.0.0.1:0").start()
    return engine, server, http, metrics


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    engine, server, http, metrics = _start(tmp_path_factory, None)
    try:
        with RegistryClient(server.address, timeout=10) as client:
            targets, drafts, qwen, rebalanced = _fill(client)
        yield History(f"http://{http.address}", server.address, metrics, targets, drafts, qwen, rebalanced)
    finally:
        http.stop()
        server.stop(grace=0.5)
        engine.dispose()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """The same, with tokens on: a worker resolves, a reader reads."""
    tokens = parse_entries([("test", f"worker:{WORKER_TOKEN}"), ("test", f"reader:{READER_TOKEN}")])
    engine, server, http, metrics = _start(tmp_path_factory, tokens)
    try:
        with RegistryClient(server.address, timeout=10, token=WORKER_TOKEN) as client:
            plan = client.resolve_load_plan(request(deepseek_config(), deployment_id="guarded-dep"))
        yield Guarded(f"http://{http.address}", server.address, plan)
    finally:
        http.stop()
        server.stop(grace=0.5)
        engine.dispose()
