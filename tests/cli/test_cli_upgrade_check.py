"""`loadplan upgrade-check`: a history on SGLang 0.5.22, checked against 0.5.23 through the CLI (and so through the
client and the CheckUpgrade RPC of the embedded registry)."""

from __future__ import annotations

import json

from cli_helpers import real_model, run


def _resolve(capsys, db, deployment, *flags):
    code, out, err = run(capsys, "resolve", "--db", db, "--deployment", deployment, "--engine", "sglang",
                         "--engine-version", "0.5.22", "--json", *flags)
    assert code == 0, err
    assert json.loads(out)["decisions"]["engine.profile"]["value"] == "sglang 0.5.22"


def test_upgrade_check_reports_changes_and_exits_non_zero_when_blocked(capsys, tmp_path):
    db = f"sqlite:///{tmp_path / 'h.db'}"
    # Qwen1.5-MoE on ascend_fuseep: 0.5.23's Qwen2-MoE block dispatches it itself (0.5.22: the normal branch)
    _resolve(capsys, db, "qwen-fuseep", "--model", real_model("qwen1.5-moe-a2.7b"), "--device", "cuda:10.0",
             "--tp-size", "8", "--a2a-backend", "ascend_fuseep", "--disable-shared-experts-fusion")
    _resolve(capsys, db, "dsv3", "--model", real_model("deepseek-v3"), "--device", "cuda:9.0", "--tp-size", "8")
    code, out, err = run(capsys, "upgrade-check", "--db", db, "--engine", "sglang", "--to", "0.5.23",
                         "--from", "0.5.22", "--json")
    assert code == 0, err
    report = json.loads(out)
    status = {d["deployment_id"]: d["status"] for d in report["deployments"]}
    assert status == {"qwen-fuseep": "changes", "dsv3": "unchanged"} and not report["blocked"]
    (role,) = next(d for d in report["deployments"] if d["deployment_id"] == "qwen-fuseep")["roles"]
    forward = next(c for c in role["changes"] if c["key"] == "moe.forward_path")
    assert (forward["before"]["value"], forward["after"]["value"]) == ("normal", "a2a")
    assert forward["before"]["rule"] != forward["after"]["rule"]
    code, out, _ = run(capsys, "upgrade-check", "--db", db, "--engine", "sglang", "--to", "0.5.23")
    assert code == 0 and "qwen-fuseep" in out and "moe.forward_path" in out and "unchanged" in out


def test_a_deployment_the_target_refuses_blocks_the_upgrade(capsys, tmp_path):
    db = f"sqlite:///{tmp_path / 'h.db'}"
    _resolve(capsys, db, "m3-nvfp4", "--model", "tests/conformance/configs/tiny-minimax-m3-nvfp4", "--device",
             "cuda:10.0", "--tp-size", "8", "--a2a-backend", "ascend_fuseep")
    code, out, err = run(capsys, "upgrade-check", "--db", db, "--engine", "sglang", "--to", "0.5.23", "--json")
    assert code == 1, (out, err)
    report = json.loads(out)
    assert report["blocked"] and report["deployments"][0]["status"] == "refused"
    assert "M3.1 NVFP4 requires --moe-a2a-backend megamoe" in report["deployments"][0]["roles"][0]["refusal"]


def test_an_unknown_release_is_refused_naming_the_known_ones(capsys, tmp_path):
    code, _, err = run(capsys, "upgrade-check", "--db", f"sqlite:///{tmp_path / 'h.db'}", "--engine", "sglang",
                       "--to", "0.6.0")
    assert code != 0 and "0.5.20" in err and "0.5.23" in err
