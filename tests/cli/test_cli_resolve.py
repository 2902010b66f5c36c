"""`loadplan resolve` in-process: the embedded registry on a temporary SQLite file."""

from __future__ import annotations

import json

import pytest
from cli_helpers import model_dir, real_model, run
from sample_requests import CONFIGS


DESIGN_KEYS = {"moe.shared_experts_fusion", "moe.num_fused_shared_experts", "moe.fused_shared_expert_scale",
               "moe.forward_path", "moe.post_experts_all_reduce", "pp.layer_range", "eplb.enabled", "eplb.layers"}


@pytest.fixture
def db(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'loadplan.db'}"


def plans_in(capsys, db: str) -> list:
    code, out, _ = run(capsys, "plans", "list", "--db", db, "--json")
    assert code == 0
    return json.loads(out)


# The decisions DESIGN 5.2 prescribes for the public configs on loadplan's CPU engine (torch runner).
EXPECTED_FUSION = {
    "deepseek-v3": (True, "deepseek.fused"),
    "kimi-k2": (False, "384"),                   # 384 routed experts, not quark: structural
    "qwen3-30b-a3b": (False, "no shared experts"),
    "qwen1.5-moe-a2.7b": (False, "moe_intermediate_size"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_FUSION))
def test_resolve_json_on_real_configs(capsys, db, name):
    code, out, err = run(capsys, "resolve", "--model", real_model(name), "--db", db, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["plan_id"] and doc["ruleset_version"]
    assert DESIGN_KEYS <= set(doc["decisions"])
    for d in doc["decisions"].values():
        assert set(d) == {"value", "reason", "rule"} and d["reason"] and d["rule"]
    fused, why = EXPECTED_FUSION[name]
    fusion = doc["decisions"]["moe.shared_experts_fusion"]
    assert fusion["value"] is fused
    assert why in fusion["reason"] + fusion["rule"]
    assert doc["decisions"]["moe.num_fused_shared_experts"]["value"] == (1 if fused else 0)
    assert [p["plan_id"] for p in plans_in(capsys, db)] == [doc["plan_id"]]


def test_resolve_flags_reach_the_plan(capsys, db):
    code, out, err = run(capsys, "resolve", "--model", real_model("deepseek-v3"), "--db", db, "--json",
                         "--deployment", "dep-a", "--role", "speculative", "--ep-size", "8", "--ep-rank", "3",
                         "--pp-size", "2", "--pp-rank", "1", "--a2a-backend", "deepep", "--device", "cuda:9.0",
                         "--enable-eplb", "--ep-num-redundant-experts", "32", "--engine", "loadplan")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["deployment_id"] == "dep-a" and doc["role"] == "speculative"
    dec = {k: v["value"] for k, v in doc["decisions"].items()}
    assert dec["moe.forward_path"] == "a2a" and dec["moe.post_experts_all_reduce"] is False
    assert dec["moe.shared_experts_fusion"] is False          # DeepEP-class backend, not enforced
    assert dec["eplb.enabled"] is True and dec["eplb.num_physical_experts"] == 288   # loadplan's engine: a draft's
    assert dec["engine.profile"].startswith("loadplan ")                              # EPLB (SGLang gives none)
    assert dec["pp.layer_range"][1] == 61 and all(dec["pp.layer_range"][0] <= i for i in dec["eplb.layers"])


def test_same_request_id_replays(capsys, db):
    args = ("resolve", "--model", real_model("qwen3-30b-a3b"), "--db", db, "--json", "--request-id", "req-1",
            "--deployment", "dep-r")
    first = json.loads(run(capsys, *args)[1])
    second = json.loads(run(capsys, *args)[1])
    assert second["plan_id"] == first["plan_id"] and second["replayed"] and not first["replayed"]
    assert len(plans_in(capsys, db)) == 1


def test_fresh_ids_by_default(capsys, db):
    a = json.loads(run(capsys, "resolve", "--model", real_model("qwen3-30b-a3b"), "--db", db, "--json")[1])
    b = json.loads(run(capsys, "resolve", "--model", real_model("qwen3-30b-a3b"), "--db", db, "--json")[1])
    assert a["plan_id"] != b["plan_id"] and a["deployment_id"] != b["deployment_id"]


def test_readable_table(capsys, db):
    code, out, _ = run(capsys, "resolve", "--model", real_model("deepseek-v3"), "--db", db)
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("KEY"))
    assert header.split() == ["KEY", "VALUE", "RULE", "REASON"]
    row = next(line for line in out.splitlines() if line.startswith("moe.shared_experts_fusion"))
    assert row.split()[1:3] == ["true", "deepseek.fused"]


def test_db_from_environment(capsys, tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv("LOADPLAN_DB_URL", url)
    code, out, _ = run(capsys, "resolve", "--model", real_model("qwen3-30b-a3b"), "--json")
    assert code == 0 and (tmp_path / "env.db").exists()
    assert [p["plan_id"] for p in plans_in(capsys, url)] == [json.loads(out)["plan_id"]]


def _kimi_without_text_config():
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25"}


def _deepseek(**kw):
    cfg = json.loads((CONFIGS / "deepseek-v3" / "config.json").read_text()) \
        if (CONFIGS / "deepseek-v3" / "config.json").is_file() else {
            "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4, "n_routed_experts": 256,
            "n_shared_experts": 1, "num_experts_per_tok": 8}
    for k, v in kw.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


BAD = [
    # (config or raw text, extra flags, status, words the one line must hold)
    ('{"architectures": ["DeepseekV3ForCausalLM"], ', [], "INVALID_ARGUMENT", ["config_json", "not valid JSON"]),
    (json.dumps(_deepseek())[:200], [], "INVALID_ARGUMENT", ["config_json", "not valid JSON"]),
    ("[1, 2, 3]", [], "INVALID_ARGUMENT", ["config_json", "JSON object"]),
    (_deepseek(n_routed_experts=None), [], "INVALID_ARGUMENT", ["config.n_routed_experts", "missing"]),
    (_deepseek(architectures=["LlamaForCausalLM"]), [], "NOT_FOUND", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"]),
    (_deepseek(), ["--a2a-backend", "nccl"], "NOT_FOUND", ["nccl", "deepep", "mooncake"]),
    (_deepseek(), ["--tp-size", "0"], "INVALID_ARGUMENT", ["parallel.tp_size"]),
    (_deepseek(), ["--ep-size", "-4"], "INVALID_ARGUMENT", ["parallel.ep_size"]),
    (_deepseek(), ["--tp-size", "2", "--tp-rank", "2"], "INVALID_ARGUMENT", ["parallel.tp_rank"]),
    (_deepseek(), ["--device", "tpu"], "INVALID_ARGUMENT", ["runtime.device", "cuda"]),
    (_kimi_without_text_config(), [], "INVALID_ARGUMENT", ["config.text_config", "missing"]),
]


@pytest.mark.parametrize("config, flags, status, words", BAD)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(capsys, tmp_path, db, config, flags, status, words):
    code, out, err = run(capsys, "resolve", "--model", model_dir(tmp_path, config), "--db", db, *flags)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {status}: "), err
    for w in words:
        assert w in lines[0]
    if (tmp_path / "loadplan.db").exists():
        assert plans_in(capsys, db) == []


@pytest.mark.parametrize("argv, words", [
    (["resolve", "--model", "/no/such/dir"], ["--model", "/no/such/dir"]),
    (["resolve"], ["--model"]),
    (["resolve", "--model", ".", "--tp-size", "two"], ["--tp-size"]),
    (["resolve", "--model", ".", "--role", "draft"], ["--role"]),
    (["nonsense"], ["nonsense"]),
    (["plans", "list", "--since", "yesterday"], ["--since"]),
    (["plans", "list", "--limit", "0"], ["--limit"]),
])
def test_usage_errors_are_one_line(capsys, db, argv, words):
    code, out, err = run(capsys, *argv, *(["--db", db] if argv[0] in ("resolve", "plans") else []))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: INVALID_ARGUMENT: "), err
    for w in words:
        assert w in lines[0]


def test_bad_database_url(capsys, tmp_path):
    code, _, err = run(capsys, "resolve", "--model", real_model("qwen3-30b-a3b"), "--db", "mysql://x/y")
    assert code == 2 and err.startswith("error: INVALID_ARGUMENT: --db") and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "resolve", "--model", real_model("qwen3-30b-a3b"),
                       "--db", f"sqlite:///{tmp_path}/missing/dir/x.db")
    assert code == 1 and err.startswith("error: UNAVAILABLE: ") and len(err.strip().splitlines()) == 1


def test_unreachable_registry(capsys):
    code, _, err = run(capsys, "resolve", "--model", real_model("qwen3-30b-a3b"), "--registry", "127.0.0.1:1",
                       "--timeout", "1")
    assert code == 1 and err.startswith("error: UNAVAILABLE: ") and len(err.strip().splitlines()) == 1


def test_resolve_on_postgres(capsys):
    """The same command on PostgreSQL; skipped without LOADPLAN_TEST_POSTGRES_URL, fails if it is unreachable."""
    import os
    import uuid

    url = os.environ.get("LOADPLAN_TEST_POSTGRES_URL")
    if not url:
        pytest.skip("LOADPLAN_TEST_POSTGRES_URL not set: PostgreSQL tests skipped (set it to "
                    "postgresql+psycopg://postgres@127.0.0.1:5432/postgres for a local server; bash .ci/run does)")
    deployment = f"cli-pg-{uuid.uuid4().hex}"
    code, out, err = run(capsys, "resolve", "--model", real_model("glm-4.5"), "--db", url, "--json",
                         "--deployment", deployment)
    assert code == 0, err
    plan = json.loads(out)
    code, out, err = run(capsys, "plans", "list", "--db", url, "--deployment", deployment, "--json")
    assert code == 0, err
    assert [p["plan_id"] for p in json.loads(out)] == [plan["plan_id"]]
