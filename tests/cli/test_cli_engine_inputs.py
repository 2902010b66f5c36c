"""The engine's own inputs through the CLI (`--engine-env`, `--engine-arg`), the client and gRPC: Qwen3.5-MoE on
hip:9.5 fuses with SGLANG_USE_AITER=1 as SGLang 0.5.23 does, not without; the history keeps what was sent."""

from __future__ import annotations

import json
import uuid

import pytest

from cli_helpers import run

from loadplan.client.errors import InvalidArgumentError
from loadplan.plan import Keys, Parallel, ResolveRequest, Runtime

MODEL = "tests/conformance/configs/tiny-qwen3_5-moe"


def _fused(capsys, db, *flags) -> dict:
    code, out, err = run(capsys, "resolve", "--db", db, "--model", MODEL, "--engine", "sglang", "--device",
                         "hip:9.5", "--tp-size", "8", "--json", *flags)
    assert code == 0, err
    return json.loads(out)


def test_the_cli_sends_the_switch_and_the_history_keeps_it(capsys, tmp_path):
    db = f"sqlite:///{tmp_path / 'h.db'}"
    on = _fused(capsys, db, "--engine-env", "SGLANG_USE_AITER=1", "--engine-arg", "chunked_prefill_size=8192")
    off = _fused(capsys, db)
    assert on["decisions"][Keys.SHARED_EXPERTS_FUSION]["value"] is True
    assert off["decisions"][Keys.SHARED_EXPERTS_FUSION]["value"] is False
    assert on["decisions"][Keys.ENGINE_INPUTS_NOT_READ]["value"] == ["arg:chunked_prefill_size"]
    code, out, err = run(capsys, "plans", "show", on["plan_id"], "--db", db, "--json")
    assert code == 0, err
    runtime = json.loads(out)["runtime"]
    assert (runtime["engine_env"], runtime["engine_args"]) == ({"SGLANG_USE_AITER": "1"},
                                                               {"chunked_prefill_size": "8192"})


def test_a_malformed_flag_or_value_names_it(capsys, tmp_path):
    db = f"sqlite:///{tmp_path / 'h.db'}"
    code, _, err = run(capsys, "resolve", "--db", db, "--model", MODEL, "--engine-env", "SGLANG_USE_AITER")
    assert code != 0 and "--engine-env: 'SGLANG_USE_AITER' is not NAME=VALUE" in err
    code, _, err = run(capsys, "resolve", "--db", db, "--model", MODEL, "--engine", "sglang", "--device", "hip:9.5",
                       "--engine-env", "SGLANG_USE_AITER=on")
    assert code != 0 and "INVALID_ARGUMENT: runtime.engine_env.SGLANG_USE_AITER" in err


def test_the_client_over_grpc(client):
    def request(env):
        config = json.loads(open(f"{MODEL}/config.json").read())
        return ResolveRequest(request_id=uuid.uuid4().hex, deployment_id=uuid.uuid4().hex, config=config,
                              parallel=Parallel(tp_size=8),
                              runtime=Runtime(engine="sglang", device="hip:9.5", engine_env=env))
    plan = client.resolve_load_plan(request({"SGLANG_USE_AITER": "1"}))
    assert plan.value(Keys.SHARED_EXPERTS_FUSION) is True
    assert plan.request.runtime.env("SGLANG_USE_AITER") == "1"
    assert client.get_plan(plan.plan_id).request.runtime.engine_env == (("SGLANG_USE_AITER", "1"),)
    assert client.resolve_load_plan(request({})).value(Keys.SHARED_EXPERTS_FUSION) is False
    with pytest.raises(InvalidArgumentError) as e:
        client.resolve_load_plan(request({"SGLANG_USE_AITER": "maybe"}))
    assert e.value.field == "runtime.engine_env.SGLANG_USE_AITER"


def test_capabilities_names_what_the_engine_starts_with_and_why_not(capsys, tmp_path):
    db = f"sqlite:///{tmp_path / 'h.db'}"
    code, out, err = run(capsys, "capabilities", "--db", db, "--model", MODEL, "--engine", "sglang", "--device",
                         "hip:9.5", "--tp-size", "8", "--engine-env", "SGLANG_USE_AITER=1", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["engine"], report["engine_version"]) == ("sglang", "0.5.23")
    backends = {c["name"]: c for c in report["backends"]}
    assert backends["none"]["starts"] and backends["none"]["shared_experts_fusion"]    # aiter fuses on ROCm
    assert backends["deepep"]["starts"] and not backends["deepep"]["shared_experts_fusion"]
    assert not backends["pplx"]["starts"] and "attention DP" in backends["pplx"]["reason"]
    assert "customized" not in backends
    assert {c["name"] for c in report["moe_runners"]} >= {"auto", "triton", "aiter"}
    # a runner whose own backend is refused still gets the report (each backend is tried in its place)
    code, out, err = run(capsys, "capabilities", "--db", db, "--model", MODEL, "--engine", "sglang", "--device",
                         "hip:9.5", "--tp-size", "8", "--a2a-backend", "pplx", "--json")
    assert code == 0, err
    assert {c["name"]: c["starts"] for c in json.loads(out)["backends"]}["none"] is True
    code, out, _ = run(capsys, "capabilities", "--db", db, "--model", MODEL, "--engine", "vllm", "--tp-size", "8")
    assert code == 0 and "passthrough" in out and "MOE RUNNER" not in out


def test_engines_lists_the_inputs_each_profile_reads(capsys):
    code, out, err = run(capsys, "engines", "--inputs", "--json")
    assert code == 0, err
    rows = {(r["engine"], r["kind"], r["name"]): r for r in json.loads(out)}
    assert rows[("sglang", "env", "SGLANG_USE_AITER")]["default"] == "false"
    assert rows[("sglang", "arg", "moe_a2a_backend")]["same_as"] == "runtime.a2a_backend"
    assert ("vllm", "arg", "all2all_backend") in rows
