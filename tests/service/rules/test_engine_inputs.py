"""The engine's own inputs (service/rules/engine_inputs.py): what each profile reads changes its answer as it changes
the engine's; what it does not read is kept and listed; malformed values and disagreeing typed fields are refused
naming the field. SGLang's own code for SGLANG_USE_AITER is held by the conformance grid's engine_env sub-grid."""

from __future__ import annotations

import json
import pathlib
import uuid

import pytest

from loadplan.errors import InvalidArgument
from loadplan.plan import Keys, Parallel, ResolveRequest, Runtime
from loadplan.engine_inputs import READS
from loadplan.service.rules.resolve import resolve_decisions

QWEN3_5 = pathlib.Path(__file__).resolve().parents[2] / "conformance" / "configs" / "tiny-qwen3_5-moe"


def _resolve(engine="sglang", device="hip:9.5", env=None, args=None, config=None, **runtime):
    config = config or json.loads((QWEN3_5 / "config.json").read_text())
    return resolve_decisions(ResolveRequest(
        request_id=uuid.uuid4().hex, deployment_id="d", config=config, parallel=Parallel(tp_size=8),
        runtime=Runtime(engine=engine, device=device, engine_env=env or {}, engine_args=args or {}, **runtime)))


@pytest.mark.parametrize("value, fused", [("1", True), ("true", True), ("TRUE", True), ("0", False),
                                          ("false", False)])
def test_qwen3_5_fuses_on_rocm_exactly_with_sglang_use_aiter(value, fused):
    d = _resolve(env={"SGLANG_USE_AITER": value}).decisions
    assert d[Keys.SHARED_EXPERTS_FUSION].value is fused
    assert d[Keys.NUM_FUSED_SHARED_EXPERTS].value == int(fused)
    assert Keys.ENGINE_INPUTS_NOT_READ not in d


def test_without_the_switch_sglangs_default_holds_and_cuda_ignores_it():
    assert _resolve().decisions[Keys.SHARED_EXPERTS_FUSION].value is False
    assert "without SGLANG_USE_AITER" in _resolve().decisions[Keys.SHARED_EXPERTS_FUSION].reason
    cuda = _resolve(device="cuda:9.0", env={"SGLANG_USE_AITER": "1"}).decisions
    assert cuda[Keys.SHARED_EXPERTS_FUSION].value is False    # _use_aiter needs is_hip()


def test_a_malformed_value_is_invalid_argument_naming_it():
    with pytest.raises(InvalidArgument) as e:
        _resolve(env={"SGLANG_USE_AITER": "yes"})
    assert e.value.field == "runtime.engine_env.SGLANG_USE_AITER" and "'yes'" in e.value.message
    with pytest.raises(InvalidArgument) as e:
        _resolve(args={"ep_num_redundant_experts": "many"})
    assert e.value.field == "runtime.engine_args.ep_num_redundant_experts"


def test_names_a_profile_does_not_read_are_listed_in_the_plan():
    d = _resolve(env={"SGLANG_USE_AITER": "1", "SGLANG_SOMETHING_ELSE": "x"},
                 args={"chunked_prefill_size": "8192"}).decisions
    assert d[Keys.ENGINE_INPUTS_NOT_READ].value == ["arg:chunked_prefill_size", "env:SGLANG_SOMETHING_ELSE"]
    assert d[Keys.SHARED_EXPERTS_FUSION].value is True
    loadplan = _resolve(engine="loadplan", device="cpu", env={"SGLANG_USE_AITER": "1"}).decisions
    assert loadplan[Keys.ENGINE_INPUTS_NOT_READ].value == ["env:SGLANG_USE_AITER"]


def test_an_argument_that_means_a_typed_field_must_agree_with_it():
    assert _resolve(args={"moe_a2a_backend": "none", "pp_size": "1", "enable_eplb": "False"})
    with pytest.raises(InvalidArgument) as e:
        _resolve(args={"moe_a2a_backend": "deepep"})
    assert e.value.field == "runtime.engine_args.moe_a2a_backend" and "runtime.a2a_backend" in e.value.message
    with pytest.raises(InvalidArgument) as e:
        _resolve(args={"pp_size": "2"})
    assert "parallel.pp_size is 1" in e.value.message
    with pytest.raises(InvalidArgument) as e:
        _resolve(engine="vllm", device="cpu", args={"tensor_parallel_size": "4"})
    assert "parallel.tp_size is 8" in e.value.message
    with pytest.raises(InvalidArgument):
        _resolve(engine="vllm", device="cpu", args={"all2all_backend": "naive"})


def test_names_and_values_are_short_text():
    with pytest.raises(InvalidArgument) as e:
        _resolve(env={"": "1"})
    assert e.value.field == "runtime.engine_env"
    with pytest.raises(InvalidArgument) as e:
        _resolve(args={"x": "v" * 5000})
    assert e.value.field == "runtime.engine_args.x"


def test_every_declared_input_parses_its_own_default():
    for engine, rows in READS.items():
        for r in rows:
            r.parse(r.default)
            assert r.kind in ("arg", "env") and r.where, (engine, r)


def test_the_sglang_adapter_sends_the_names_the_profile_reads_from_the_server():
    """engine_inputs_of reads a ServerArgs-like object and the environment: only the names the profile declares."""
    from types import SimpleNamespace

    from loadplan.integrations.sglang import engine_inputs_of

    server_args = SimpleNamespace(moe_a2a_backend=None, moe_runner_backend="triton", enable_eplb=False,
                                  ep_num_redundant_experts=0, disable_shared_experts_fusion=False,
                                  enforce_shared_experts_fusion=True, enable_single_batch_overlap=False,
                                  enable_two_batch_overlap=False, pp_size=1, port=30000)
    sent = engine_inputs_of(server_args, {"SGLANG_USE_AITER": "1", "SGLANG_OTHER": "x", "HOME": "/root"})
    assert sent["engine_env"] == {"SGLANG_USE_AITER": "1"}
    assert sent["engine_args"]["moe_a2a_backend"] == "none" and "port" not in sent["engine_args"]
    assert sent["engine_args"]["enforce_shared_experts_fusion"] == "True"
    request = ResolveRequest(request_id="r", deployment_id="d", config=json.loads((QWEN3_5 / "config.json").read_text()),
                             runtime=Runtime(engine="sglang", device="hip:9.5", moe_runner_backend="triton",
                                             enforce_shared_experts_fusion=True, **sent))
    assert resolve_decisions(request).decisions[Keys.SHARED_EXPERTS_FUSION].value is True
