"""ResolveLoadPlan and the audit calls through a real gRPC server over the fake store."""

from __future__ import annotations

import dataclasses
import datetime as dt

import grpc
import pytest
from sample_requests import decided, deepseek_config, real_config, request

from loadplan.plan import Decision, Keys, Parallel, ResolveRequest, Runtime
from loadplan.service.rules.backends import BACKENDS
from loadplan.service.rules.entries import ENTRY_CLASSES
from loadplan.service.rules.resolve import resolve_decisions
from loadplan.v1 import registry_pb2 as pb
from loadplan.v1 import registry_pb2_grpc as pb_grpc


def test_resolve_round_trip_equals_the_stored_domain_plan(client, store):
    req = request(parallel=Parallel(tp_size=2, tp_rank=1), host="node-7")
    plan = client.resolve_load_plan(req)

    assert store.count() == 1
    assert plan == store.plans[plan.plan_id]
    assert plan.request == decided(req) and not plan.replayed
    expected = resolve_decisions(req).decisions
    assert {k: dataclasses.replace(d, decided_at=None) for k, d in plan.decisions.items()} == expected
    # JSON on the wire keeps integers and floats apart.
    assert type(plan.value(Keys.NUM_FUSED_SHARED_EXPERTS)) is int
    assert type(plan.value(Keys.FUSED_SHARED_EXPERT_SCALE)) is float
    assert plan.created_at is not None and plan.created_at.tzinfo is not None


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "glm-4.5", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b"])
def test_real_configs_resolve_through_the_wire(client, store, name):
    cfg = real_config(name)
    assert cfg is not None, f"tests/data/configs/{name}/config.json is missing"
    req = request(cfg, quantization_config=cfg.get("quantization_config"))
    plan = client.resolve_load_plan(req)
    assert plan == store.plans[plan.plan_id]
    assert plan.entry_class == cfg["architectures"][0]
    assert set(plan.decisions) >= {Keys.SHARED_EXPERTS_FUSION, Keys.FORWARD_PATH, Keys.POST_EXPERTS_ALL_REDUCE,
                                   Keys.PP_LAYER_RANGE, Keys.EPLB_ENABLED, Keys.EPLB_LAYERS}


def test_replayed_request_id_returns_the_stored_plan_and_writes_nothing(client, store):
    req = request()
    first = client.resolve_load_plan(req)
    again = client.resolve_load_plan(req)
    assert again.replayed and not first.replayed
    assert dataclasses.replace(again, replayed=False) == first
    assert store.count() == 1


def test_ranks_of_one_deployment_share_decisions(client, store):
    plans = [client.resolve_load_plan(request(deployment_id="dep-pp", parallel=Parallel(pp_size=2, pp_rank=r)))
             for r in range(2)]
    wide = [{k: d.value for k, d in p.decisions.items() if d.deployment_wide} for p in plans]
    assert wide[0] == wide[1]
    assert plans[0].value(Keys.PP_LAYER_RANGE) != plans[1].value(Keys.PP_LAYER_RANGE)


def test_request_without_parallel_or_runtime_gets_the_defaults(server, store):
    with grpc.insecure_channel(server.address) as ch:
        reply = pb_grpc.ModelRegistryStub(ch).ResolveLoadPlan(pb.ResolveLoadPlanRequest(
            request_id="r-defaults", deployment_id="d", config_json='{"architectures": ["Qwen3MoeForCausalLM"], '
            '"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8}'),
            timeout=5)
    stored = store.plans[reply.plan_id].request
    assert stored.parallel == Parallel() and stored.runtime == decided(request()).runtime and stored.role == "target"


def test_get_list_and_diff(client, store):
    t0 = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1)
    target = client.resolve_load_plan(request(deployment_id="dep-d", host="h1"))
    draft = client.resolve_load_plan(request(deployment_id="dep-d", role="speculative", host="h2",
                                             runtime=Runtime(disable_shared_experts_fusion=True)))
    client.resolve_load_plan(request(deployment_id="other"))

    assert client.get_plan(target.plan_id) == store.get_plan(target.plan_id)
    assert {p.plan_id for p in client.iter_plans(deployment_id="dep-d", page_size=1)} == \
        {target.plan_id, draft.plan_id}
    page, token = client.list_plans(deployment_id="dep-d", page_size=1)
    assert len(page) == 1 and token
    assert [p.plan_id for p in client.iter_plans(role="speculative")] == [draft.plan_id]
    assert [p.plan_id for p in client.iter_plans(host="h1")] == [target.plan_id]
    assert len(list(client.iter_plans(created_after=t0))) == 3
    assert list(client.iter_plans(created_before=t0)) == []

    diff = client.diff_plans(target.plan_id, draft.plan_id)
    assert diff.a == target and diff.b.plan_id == draft.plan_id
    keys = {k for k, _, _ in diff.decisions}
    assert Keys.SHARED_EXPERTS_FUSION in keys and Keys.FORWARD_PATH not in keys
    fusion = next((a, b) for k, a, b in diff.decisions if k == Keys.SHARED_EXPERTS_FUSION)
    assert fusion[0].value is True and fusion[1].value is False
    inputs = {f: (a, b) for f, a, b in diff.inputs}
    assert inputs["role"] == ("target", "speculative")
    assert inputs["runtime.disable_shared_experts_fusion"] == (False, True)


def test_append_decisions_revisions_and_history(client, store):
    plan = client.resolve_load_plan(request(runtime=Runtime(enable_eplb=True)))
    placement = Decision(Keys.EPLB_PLACEMENT, [[0, 1], [1, 0]], "rebalanced after 1000 steps", "eplb.rebalance")
    after = client.append_decisions("append-1", plan.plan_id, [placement])
    assert after.value(Keys.EPLB_PLACEMENT) == [[0, 1], [1, 0]]
    again = client.append_decisions("append-1", plan.plan_id, [placement])
    assert again.decisions == after.decisions
    history = client.get_plan(plan.plan_id, include_history=True).history
    assert [d.key for d in history].count(Keys.EPLB_PLACEMENT) == 1
    assert len(history) == len(plan.decisions) + 1


def test_list_backends_is_the_capability_table(client):
    rows = {b.name: b for b in client.list_backends()}
    assert set(rows) == set(BACKENDS)
    for name, row in BACKENDS.items():
        got = dataclasses.asdict(rows[name])
        assert {k: got[k] for k in dataclasses.asdict(row)} == dataclasses.asdict(row)
        assert (got["accepted"], got["engine"]) == (True, "loadplan")


def test_list_backends_answers_the_engine_and_release_asked(client):
    from loadplan.client.errors import NotFoundError

    rows = client.list_backends("vllm", "0.31.0")
    assert {(r.engine, r.engine_version) for r in rows} == {("vllm", "0.31.0")}
    assert "passthrough" not in {r.name for r in rows} and "passthrough" in {r.name for r in client.list_backends("vllm")}
    with pytest.raises(NotFoundError) as e:
        client.list_backends("sglang", "0.5.9")
    assert e.value.field == "engine_version" and "0.5.23" in e.value.message


def test_check_coverage(client):
    report = client.check_coverage(["KimiK25ForConditionalGeneration", "Qwen3MoeForCausalLM", "LlamaForCausalLM"])
    kimi, qwen3, llama = report.entries
    assert kimi.ok and kimi.chain == ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM")
    assert kimi.family == "deepseek" and kimi.gated_family and kimi.has_gate
    assert qwen3.ok and not qwen3.gated_family
    assert not llama.known and not llama.ok and "DeepseekV3ForCausalLM" in llama.message
    assert not report.ok

    whole = client.check_coverage([])
    assert whole.ok and {e.entry_class for e in whole.entries} == set(ENTRY_CLASSES)


def test_echo(client):
    assert client.echo(b"\x00payload") == b"\x00payload"


def test_request_dataclass_is_what_is_sent():
    # Guard for the round-trip test above: ResolveRequest compares by value, including the config.
    assert request(request_id="x") == request(request_id="x")
    assert request(request_id="x") != request(request_id="x", config=deepseek_config(num_hidden_layers=5))
    assert isinstance(request(), ResolveRequest)
