"""The HTTP side without a browser: who may read the history, and what /metrics counts."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import grpc
import pytest
from sample_requests import deepseek_config, request
from web_tokens import READER_TOKEN, WORKER_TOKEN

from loadplan.client.convert import request_to_pb
from loadplan.v1 import registry_pb2_grpc as pb_grpc


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()


def test_the_history_needs_a_readers_token(guarded):
    base, plan = guarded.base, guarded.plan
    status, headers, _ = get(f"{base}/plans/{plan.plan_id}")
    assert status == 401 and headers["www-authenticate"].startswith("Bearer")
    status, _, body = get(f"{base}/plans/{plan.plan_id}", {"Authorization": f"Bearer {WORKER_TOKEN}"})
    assert status == 403 and "worker token may not read" in body
    status, _, body = get(f"{base}/plans/{plan.plan_id}", {"Authorization": f"Bearer {READER_TOKEN}"})
    assert status == 200 and plan.plan_id in body
    status, _, body = get(f"{base}/deployments", {"Cookie": f"loadplan_token={READER_TOKEN}"})
    assert status == 200 and "guarded-dep" in body


def test_metrics_stay_open_for_scrapers(guarded):
    base = guarded.base
    status, headers, body = get(f"{base}/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert 'loadplan_resolves_total{engine="loadplan",family="deepseek",role="target",status="OK"} 1.0' in body
    # The worker's resolve went through authentication; a call without a token is counted too.
    with grpc.insecure_channel(guarded.grpc) as ch, pytest.raises(grpc.RpcError):
        pb_grpc.ModelRegistryStub(ch).ResolveLoadPlan(request_to_pb(request(deepseek_config())), timeout=5)
    # grpc.aio's abort sends the status before the interceptor's count runs: the scrape may be a moment behind.
    want = 'loadplan_resolves_total{engine="",family="",role="",status="UNAUTHENTICATED"} 1.0'
    deadline = time.monotonic() + 5
    while want not in (body := get(f"{base}/metrics")[2]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert want in body



def test_metrics_count_refusals_and_time_commits(history):
    """By status: a refused resolve is counted with the request's role, and timed; the group
    commits of the fixture's eight resolved plans are timed and sized (its observed one is saved alone)."""
    bad = request_to_pb(request(deepseek_config(), deployment_id="x", role="speculative"))
    bad.config_json = "{not json"
    with grpc.insecure_channel(history.grpc) as ch, pytest.raises(grpc.RpcError) as info:
        pb_grpc.ModelRegistryStub(ch).ResolveLoadPlan(bad, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _, _, body = get(f"{history.base}/metrics")
    assert 'loadplan_resolves_total{engine="",family="",role="speculative",status="INVALID_ARGUMENT"} 1.0' in body
    assert 'loadplan_resolves_total{engine="loadplan",family="deepseek",role="target",status="OK"} 4.0' in body
    assert 'loadplan_resolves_total{engine="loadplan",family="deepseek",role="speculative",status="OK"} 2.0' in body
    assert 'loadplan_resolves_total{engine="loadplan",family="qwen3_moe",role="target",status="OK"} 1.0' in body
    assert 'loadplan_resolves_total{engine="sglang",family="qwen2_moe",role="target",status="OK"} 1.0' in body
    assert 'loadplan_resolve_seconds_count{status="INVALID_ARGUMENT"} 1.0' in body
    commits = history.metrics.commit_plans.collect()[0].samples
    total = next(s.value for s in commits if s.name == "loadplan_db_commit_plans_sum")
    assert total == 8.0                                  # every plan written once, in some group
    assert "loadplan_db_commit_seconds_count" in body and "loadplan_serving 1.0" in body
