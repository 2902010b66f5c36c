"""`loadplan plans list|show|diff`, `backends`, `coverage`, embedded and against a running registry."""

from __future__ import annotations

import json
import sys
import types

import pytest
from cli_helpers import real_model, run

from loadplan.cli import coverage as coverage_cmd
from loadplan.service.rules.backends import BACKENDS
from loadplan.service.rules.entries import ENTRY_CLASSES


@pytest.fixture
def db(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'audit.db'}"


def resolve(capsys, where: list[str], *flags: str) -> dict:
    code, out, err = run(capsys, "resolve", "--model", real_model("deepseek-v3"), *where, "--json", *flags)
    assert code == 0, err
    return json.loads(out)


def test_plans_list_show_diff(capsys, db):
    where = ["--db", db]
    target = resolve(capsys, where, "--deployment", "dep-1")
    draft = resolve(capsys, where, "--deployment", "dep-1", "--role", "speculative",
                    "--disable-shared-experts-fusion")
    other = resolve(capsys, where, "--deployment", "dep-2")

    listed = json.loads(run(capsys, "plans", "list", *where, "--json")[1])
    assert [p["plan_id"] for p in listed] == [other["plan_id"], draft["plan_id"], target["plan_id"]]
    assert listed[0]["created_at"] and listed[0]["parallel"]["tp_size"] == 1
    only = json.loads(run(capsys, "plans", "list", *where, "--deployment", "dep-1", "--role", "speculative",
                          "--json")[1])
    assert [p["plan_id"] for p in only] == [draft["plan_id"]]
    assert len(json.loads(run(capsys, "plans", "list", *where, "--limit", "2", "--json")[1])) == 2
    assert json.loads(run(capsys, "plans", "list", *where, "--entry-class", "Qwen3MoeForCausalLM",
                          "--json")[1]) == []
    assert json.loads(run(capsys, "plans", "list", *where, "--until", "2000-01-01", "--json")[1]) == []
    assert len(json.loads(run(capsys, "plans", "list", *where, "--since", "2000-01-01T00:00:00Z",
                              "--json")[1])) == 3
    code, table, _ = run(capsys, "plans", "list", *where)
    assert code == 0 and target["plan_id"] in table and "DeepseekV3ForCausalLM" in table

    shown = json.loads(run(capsys, "plans", "show", target["plan_id"], *where, "--json")[1])
    assert shown["decisions"] == target["decisions"] and "history" not in shown
    with_history = json.loads(run(capsys, "plans", "show", target["plan_id"], *where, "--history", "--json")[1])
    assert {h["key"] for h in with_history["history"]} == set(target["decisions"])
    code, text, _ = run(capsys, "plans", "show", target["plan_id"], *where, "--history")
    assert code == 0 and "REV" in text and "moe.shared_experts_fusion" in text

    diff = json.loads(run(capsys, "plans", "diff", target["plan_id"], draft["plan_id"], *where, "--json")[1])
    keys = {d["key"]: d for d in diff["decisions"]}
    assert keys["moe.shared_experts_fusion"]["a"]["value"] is True
    assert keys["moe.shared_experts_fusion"]["b"]["value"] is False
    assert {"role", "runtime.disable_shared_experts_fusion"} <= {i["field"] for i in diff["inputs"]}
    code, text, _ = run(capsys, "plans", "diff", target["plan_id"], draft["plan_id"], *where)
    assert code == 0 and "moe.shared_experts_fusion" in text and "runtime.disable_shared_experts_fusion" in text


def test_plans_show_unknown(capsys, db):
    code, out, err = run(capsys, "plans", "show", "nope", "--db", db)
    assert code == 2 and out == "" and err.startswith("error: NOT_FOUND: ") and "nope" in err


def test_against_a_running_registry(capsys, server, store):
    where = ["--registry", server.address]
    plan = resolve(capsys, where, "--deployment", "dep-remote")
    assert store.count() == 1 and plan["plan_id"] in store.plans
    listed = json.loads(run(capsys, "plans", "list", *where, "--json")[1])
    assert [p["plan_id"] for p in listed] == [plan["plan_id"]]


def test_backends(capsys, db):
    code, out, _ = run(capsys, "backends", "--db", db, "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(rows) == set(BACKENDS)
    assert rows["flashinfer"]["fusion_force_disabled"] and rows["mori"]["deepep_class"]
    code, out, _ = run(capsys, "backends", "--db", db)
    assert code == 0 and all(name in out for name in BACKENDS)


def _fake_engine(monkeypatch, names):
    module = types.ModuleType("fake_engine_registry")
    module.ENGINE_ENTRY_CLASSES = {n: ("somewhere", n) for n in names}
    monkeypatch.setitem(sys.modules, "fake_engine_registry", module)
    monkeypatch.setattr(coverage_cmd, "SOURCES", [("engine", "fake_engine_registry", "ENGINE_ENTRY_CLASSES")])


def test_coverage_of_the_engine_table(capsys, db, monkeypatch):
    _fake_engine(monkeypatch, ["DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"])
    code, out, err = run(capsys, "coverage", "--db", db, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["source"] == "engine" and doc["ok"]
    assert [e["entry_class"] for e in doc["entries"]] == ["DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"]


def test_coverage_fails_for_an_ungated_engine_class(capsys, db, monkeypatch):
    _fake_engine(monkeypatch, ["DeepseekV3ForCausalLM", "MyNewWrapperForConditionalGeneration"])
    code, out, _ = run(capsys, "coverage", "--db", db)
    assert code == 1
    bad = next(line for line in out.splitlines() if line.startswith("MyNewWrapperForConditionalGeneration"))
    assert "FAIL" in bad and "not supported" in bad


def test_coverage_falls_back_to_the_registry_table(capsys, db, monkeypatch):
    monkeypatch.setattr(coverage_cmd, "SOURCES", [("engine", "no_such_engine_module_xyz", "ENGINE_ENTRY_CLASSES")])
    code, out, err = run(capsys, "coverage", "--db", db, "--json")
    assert code == 0
    assert "no_such_engine_module_xyz" in err and "registry" in err
    doc = json.loads(out)
    assert doc["source"] == "registry" and {e["entry_class"] for e in doc["entries"]} == set(ENTRY_CLASSES)
