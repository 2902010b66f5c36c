"""Every class of bad input gets its status, a message naming the field or the known
values, the field in trailing metadata, and leaves no plan behind (DESIGN 7)."""

from __future__ import annotations

import json
import logging

import grpc
import pytest
from sample_requests import deepseek_config, request

from loadplan.client import RegistryCallError
from loadplan.client.convert import request_to_pb
from loadplan.plan import Parallel, Runtime
from loadplan.errors import Unavailable
from loadplan.v1 import registry_pb2 as pb
from loadplan.v1 import registry_pb2_grpc as pb_grpc


def raw_call(server, msg: pb.ResolveLoadPlanRequest) -> grpc.RpcError:
    """Send a request the typed client would never build; return the error."""
    with grpc.insecure_channel(server.address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.ModelRegistryStub(ch).ResolveLoadPlan(msg, timeout=5)
    return info.value


def field_of(err: grpc.RpcError) -> str | None:
    return dict(err.trailing_metadata() or ()).get("loadplan-field")


def good_pb(**overrides) -> pb.ResolveLoadPlanRequest:
    msg = request_to_pb(request())
    for k, v in overrides.items():
        setattr(msg, k, v)
    return msg


@pytest.mark.parametrize("field, text, says", [
    ("config_json", "{not json", "not valid JSON"),
    ("config_json", json.dumps(deepseek_config())[:-25], "not valid JSON"),           # truncated
    ("config_json", "[1, 2]", "must be a JSON object"),
    ("config_json", "", "required"),
    ("config_json", '{"a": ' * 100 + "1" + "}" * 100, "nested deeper than"),
    ("config_json", "[" * 100_000, "nested too deeply"),
    ("quantization_config_json", '{"quant_method": ', "not valid JSON"),
    ("quantization_config_json", '"fp8"', "must be a JSON object"),
])
def test_malformed_json_is_invalid_argument(server, store, field, text, says):
    err = raw_call(server, good_pb(**{field: text}))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.details() and says in err.details()
    assert field_of(err) == field
    assert store.count() == 0


def test_unknown_role_number_is_invalid_argument(server, store):
    err = raw_call(server, good_pb(role=7))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field_of(err) == "role"
    assert "target" in err.details() and store.count() == 0


def _expect(client, store, req, code: str, field: str, *needles: str) -> RegistryCallError:
    with pytest.raises(RegistryCallError) as info:
        client.resolve_load_plan(req)
    err = info.value
    assert err.code == code, err
    assert err.field == field
    # INVALID_ARGUMENT names the field in the message; NOT_FOUND names the known values
    # instead and carries the field in metadata only.
    for needle in ((field,) if code == "INVALID_ARGUMENT" else ()) + needles:
        assert needle in err.message, (needle, err.message)
    assert store.count() == 0
    return err


@pytest.mark.parametrize("missing", ["n_routed_experts", "num_hidden_layers", "num_experts_per_tok"])
def test_missing_required_config_field(client, store, missing):
    cfg = deepseek_config()
    del cfg[missing]
    _expect(client, store, request(cfg), "INVALID_ARGUMENT", f"config.{missing}", "missing")


def test_missing_architectures(client, store):
    cfg = deepseek_config()
    del cfg["architectures"]
    _expect(client, store, request(cfg), "INVALID_ARGUMENT", "config.architectures", "missing")


def test_unknown_architecture_lists_the_known_ones(client, store):
    err = _expect(client, store, request(deepseek_config(architectures=["LlamaForCausalLM"])), "NOT_FOUND",
                  "config.architectures", "LlamaForCausalLM", "DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM")
    assert type(err).__name__ == "NotFoundError"


def test_unknown_backend_lists_the_known_ones(client, store):
    _expect(client, store, request(runtime=Runtime(a2a_backend="nccl")), "NOT_FOUND", "runtime.a2a_backend",
            "nccl", "deepep", "mori", "megamoe")


@pytest.mark.parametrize("parallel, field", [
    (Parallel(tp_size=0), "parallel.tp_size"),      # given on purpose: the client refuses it
    (Parallel(ep_size=-2), "parallel.ep_size"),     # the rest: the server
    (Parallel(pp_size=-1, pp_rank=0), "parallel.pp_size"),
    (Parallel(dp_size=-1), "parallel.dp_size"),
])
def test_zero_or_negative_sizes(client, store, parallel, field):
    _expect(client, store, request(parallel=parallel), "INVALID_ARGUMENT", field, ">= 1")


def test_unset_sizes_mean_one(server, store):
    """proto3 cannot tell an unset size from 0: a Parallelism that sets only ep_size is EP 2 x
    TP 1 x PP 1 x DP 1, as the proto says, not refused for the sizes it left out."""
    msg = request_to_pb(request())
    msg.parallel.Clear()
    msg.parallel.ep_size, msg.parallel.ep_rank = 2, 1
    with grpc.insecure_channel(server.address) as ch:
        plan = pb_grpc.ModelRegistryStub(ch).ResolveLoadPlan(msg, timeout=5)
    got = plan.parallel
    assert (got.tp_size, got.ep_size, got.pp_size, got.dp_size) == (1, 2, 1, 1)
    assert (got.tp_rank, got.ep_rank, got.pp_rank, got.dp_rank) == (0, 1, 0, 0)
    assert store.count() == 1


@pytest.mark.parametrize("parallel, field", [
    (Parallel(tp_size=2, tp_rank=2), "parallel.tp_rank"),
    (Parallel(ep_size=4, ep_rank=7), "parallel.ep_rank"),
    (Parallel(pp_size=2, pp_rank=-1), "parallel.pp_rank"),
])
def test_rank_not_below_its_size(client, store, parallel, field):
    _expect(client, store, request(parallel=parallel), "INVALID_ARGUMENT", field)


def test_wrapper_without_text_config(client, store):
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25"}
    _expect(client, store, request(cfg), "INVALID_ARGUMENT", "config.text_config", "missing")


def test_required_ids(client, store):
    _expect(client, store, request(deployment_id=""), "INVALID_ARGUMENT", "deployment_id", "required")


def test_rank_with_different_deployment_inputs_is_failed_precondition(client, store):
    client.resolve_load_plan(request(deployment_id="dep-x", parallel=Parallel(ep_size=2, ep_rank=0)))
    with pytest.raises(RegistryCallError) as info:
        client.resolve_load_plan(request(deployment_id="dep-x", parallel=Parallel(ep_size=2, ep_rank=1),
                                         runtime=Runtime(a2a_backend="deepep")))
    err = info.value
    assert err.code == "FAILED_PRECONDITION" and "runtime.a2a_backend" in err.message
    assert err.field == "runtime.a2a_backend"
    assert store.count() == 1


def test_reused_request_id_for_another_request_is_failed_precondition(client, store):
    client.resolve_load_plan(request(request_id="same-id"))
    with pytest.raises(RegistryCallError) as info:
        client.resolve_load_plan(request(request_id="same-id", host="elsewhere"))
    assert info.value.code == "FAILED_PRECONDITION" and info.value.field == "request_id"
    assert store.count() == 1


def test_unknown_plan(client):
    with pytest.raises(RegistryCallError) as info:
        client.get_plan("no-such-plan")
    assert info.value.code == "NOT_FOUND" and "no-such-plan" in info.value.message
    with pytest.raises(RegistryCallError) as info:
        client.get_plan("")
    assert info.value.code == "INVALID_ARGUMENT" and info.value.field == "plan_id"


def test_bad_page_size_and_token(client):
    with pytest.raises(RegistryCallError) as info:
        client.list_plans(page_size=100000)
    assert info.value.code == "INVALID_ARGUMENT" and info.value.field == "page_size"
    with pytest.raises(RegistryCallError) as info:
        client.list_plans(page_token="garbage")
    assert info.value.code == "INVALID_ARGUMENT" and info.value.field == "page_token"


def test_request_over_the_message_size_limit_is_refused(server, store):
    cfg = deepseek_config(padding="x" * (5 * 1024 * 1024))   # the default limit is 4 MiB
    err = raw_call(server, request_to_pb(request(cfg)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert store.count() == 0
    # The server is still healthy for normal requests.
    with grpc.insecure_channel(server.address) as ch:
        pb_grpc.ModelRegistryStub(ch).ResolveLoadPlan(request_to_pb(request()), timeout=5)
    assert store.count() == 1


class _ExplodingStore:
    def __init__(self, exc):
        self.exc = exc

    def save_batch(self, news):
        raise self.exc

    def ready(self):
        return True


def test_unexpected_error_is_internal_and_does_not_leak(caplog):
    from loadplan.client import RegistryClient
    from loadplan.service.server import RegistryServer, ServerOptions

    with RegistryServer(_ExplodingStore(RuntimeError("password=hunter2 at db.internal")),
                        ServerOptions(listen="127.0.0.1:0", max_workers=2)) as srv, \
            RegistryClient(srv.address, timeout=5) as client, caplog.at_level(logging.ERROR, "loadplan.service"):
        with pytest.raises(RegistryCallError) as info:
            client.resolve_load_plan(request())
    assert info.value.code == "INTERNAL"
    assert "hunter2" not in info.value.message and "incident" in info.value.message
    incident = info.value.message.split("incident ")[1].split(";")[0]
    logged = [r for r in caplog.records if incident in r.getMessage()]
    assert logged and logged[0].exc_info is not None   # the traceback is in the server log


def test_store_unavailable_is_unavailable():
    from loadplan.client import RegistryClient, UnavailableError
    from loadplan.service.server import RegistryServer, ServerOptions

    with RegistryServer(_ExplodingStore(Unavailable("database unavailable while saving a plan")),
                        ServerOptions(listen="127.0.0.1:0", max_workers=2)) as srv, \
            RegistryClient(srv.address, timeout=5, max_attempts=2, backoff=0.01) as client:
        with pytest.raises(UnavailableError) as info:
            client.resolve_load_plan(request())
    assert "database unavailable" in info.value.message


def test_malformed_appended_value_is_invalid_argument(client, server):
    plan = client.resolve_load_plan(request())
    msg = pb.AppendDecisionsRequest(request_id="a-1", plan_id=plan.plan_id, decisions=[
        pb.Decision(key="eplb.placement", value_json="[1, 2", reason="r", rule="eplb.rebalance")])
    with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as info:
        pb_grpc.ModelRegistryStub(ch).AppendDecisions(msg, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(info.value) == "decisions[0].value_json"
    assert client.get_plan(plan.plan_id).decisions == plan.decisions
