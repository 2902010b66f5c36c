"""`loadplan engines` and `--engine`: the profile that decides, named on the command line."""

from __future__ import annotations

import json

import pytest
from cli_helpers import real_model, run


def test_engines_lists_every_release_with_its_status(capsys):
    code, out, _ = run(capsys, "engines", "--json")
    assert code == 0
    rows = {(r["name"], r["release"]): r for r in json.loads(out)}
    assert {v for n, v in rows if n == "sglang"} == {"0.5.20", "0.5.21", "0.5.22", "0.5.23"}
    assert rows[("sglang", "0.5.23")]["status"] == "profiled, newest (the default)"
    assert rows[("sglang", "0.5.22")]["status"] == "profiled"
    assert rows[("vllm", "0.32.0")]["version"] == "0.32.0"
    assert rows[next(k for k in rows if k[0] == "loadplan")]["default_for"] == ["cpu"]
    code, out, _ = run(capsys, "engines")
    assert code == 0 and "0.5.20" in out and "0.5.23" in out and "0.32.0" in out


def test_resolve_records_the_engine_that_decided(capsys, tmp_path):
    db = f"sqlite:///{tmp_path / 'e.db'}"
    code, out, err = run(capsys, "resolve", "--model", real_model("deepseek-v3"), "--db", db, "--device", "cuda:9.0",
                         "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["decisions"]["engine.profile"]["value"] == "sglang 0.5.23"
    code, out, err = run(capsys, "plans", "show", plan["plan_id"], "--db", db, "--json")
    assert code == 0, err
    runtime = json.loads(out)["runtime"]
    assert (runtime["engine"], runtime["engine_version"]) == ("sglang", "0.5.23")
    code, out, err = run(capsys, "resolve", "--model", real_model("deepseek-v3"), "--db", db, "--engine", "nope")
    assert code != 0 and "runtime.engine" in err and "sglang" in err


def test_generate_offers_no_engine_flag(capsys):
    """The worker runs loadplan's own engine, so it always asks for that one."""
    with pytest.raises(SystemExit) as done:   # argparse's --help exits 0
        run(capsys, "generate", "--help")
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--prompt-ids" in out and "--engine" not in out
    with pytest.raises(SystemExit):
        run(capsys, "resolve", "--help")
    assert "--engine" in capsys.readouterr().out
