"""`loadplan demo` end to end, as `make demo` runs it (a subprocess of the console script).

It must leave in its SQLite history what it printed: one deployment, a target and a
speculative plan for each of its EP ranks, pinned to the same deployment-wide
decisions per role, and a report showing both runners' values and reasons.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from deploy_helpers import DEMO_MAX_NEW_TOKENS, clean_env

pytestmark = [pytest.mark.heavy(18), pytest.mark.timeout(240)]

LOADPLAN = str(Path(sys.executable).parent / "loadplan")


@pytest.fixture(scope="module")
def demo(demo_run):
    return demo_run


def _plans(db: Path) -> list[dict]:
    """Every plan of the demo's database, read back through the store."""
    from loadplan.service.registry import PlanFilter
    from loadplan.service.store import SqlPlanStore
    from loadplan.service.store.db import make_engine

    engine = make_engine(f"sqlite:///{db}")
    try:
        plans, _ = SqlPlanStore(engine).list_plans(PlanFilter(), 500, None)
    finally:
        engine.dispose()
    return [{"plan_id": p.plan_id, "deployment_id": p.request.deployment_id, "role": p.request.role,
             "ep_rank": p.request.parallel.ep_rank, "ep_size": p.request.parallel.ep_size,
             "entry_class": p.entry_class,
             "decisions": {k: (d.value, d.reason) for k, d in p.decisions.items()}} for p in plans]


def test_demo_records_target_and_draft_plans_of_two_ep_ranks(demo):
    root, proc = demo
    plans = _plans(root / "loadplan.db")
    assert len({p["deployment_id"] for p in plans}) == 1
    roles = {}
    for p in plans:
        assert p["ep_size"] == 2
        roles.setdefault(p["role"], set()).add(p["ep_rank"])
    assert roles == {"target": {0, 1}, "speculative": {0, 1}}
    target = [p for p in plans if p["role"] == "target"]
    draft = [p for p in plans if p["role"] == "speculative"]
    assert {p["entry_class"] for p in target} == {"DeepseekV3ForCausalLM"}
    assert {p["entry_class"] for p in draft} == {"Qwen3MoeForCausalLM"}
    # 256 routed experts + 1 shared: the target fuses; the draft has no shared expert to fuse.
    for p in target:
        assert p["decisions"]["moe.shared_experts_fusion"][0] is True
        assert p["decisions"]["moe.fused_shared_expert_scale"][0] == 0.5      # 1/ep_size on the normal path
        assert p["decisions"]["moe.post_experts_all_reduce"][0] is True
    for p in draft:
        assert p["decisions"]["moe.shared_experts_fusion"][0] is False
    # the deployment id the report names is the one in the database
    assert plans[0]["deployment_id"] in proc.stdout


def test_demo_prints_both_runners_decisions_reasons_and_the_diff(demo):
    root, proc = demo
    out = proc.stdout
    plans = {p["plan_id"]: p for p in _plans(root / "loadplan.db")}
    row = re.search(r"^moe\.shared_experts_fusion\*?\s+true\s+false\s+target: (.+)$", out, re.M)
    assert row, out
    t0 = next(p for p in plans.values() if p["role"] == "target" and p["ep_rank"] == 0)
    d0 = next(p for p in plans.values() if p["role"] == "speculative" and p["ep_rank"] == 0)
    assert t0["decisions"]["moe.shared_experts_fusion"][1] in row.group(1)
    assert f"draft:  {d0['decisions']['moe.shared_experts_fusion'][1]}" in out
    assert f"loadplan plans diff {t0['plan_id']} {d0['plan_id']}" in out
    diff = out[out.index("audit diff"):]
    assert re.search(r"^moe\.shared_experts_fusion\s+true\s+false$", diff, re.M), diff
    assert re.search(r"^role\s+\"target\"\s+\"speculative\"$", diff, re.M), diff
    tokens = re.search(r"^\s+output\s+([\d ]+)$", out, re.M)
    assert tokens and len(tokens.group(1).split()) == DEMO_MAX_NEW_TOKENS
    # The checkpoints share a learned successor map (make_checkpoints.py), so the draft is right far more
    # often than chance (1 in 128): speculative decoding has something to show.
    rate = re.search(r"draft acceptance ([\d.]+) \((\d+)/(\d+) proposed", out)
    assert rate and float(rate.group(1)) > 0.2 and int(rate.group(3)) > 0, out
    # progress bars for loading and generation, on stderr
    assert "loading" in proc.stderr and "generating" in proc.stderr


def test_the_commands_the_demo_suggests_work(demo):
    root, proc = demo
    suggested = [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith(".venv/bin/loadplan")]
    assert len(suggested) == 3
    for line in suggested:
        argv = [LOADPLAN, *line.split()[1:]]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=root.parent, env=clean_env())
        assert res.returncode == 0, f"{line}\n{res.stderr}"
        assert res.stdout.strip()


def _output_tokens(stdout: str) -> list[str]:
    tokens = re.search(r"^\s+output\s+([\d ]+)$", stdout, re.M)
    assert tokens, stdout
    return tokens.group(1).split()


def test_demo_with_the_targets_own_nextn_draft(demo, tmp_path):
    """`--draft nextn`: DeepSeek's own MTP draft, the same architecture code as its target (DESIGN 1).
    Both runners fuse on every rank; the plans differ in family and layer range only; the output is
    the target's greedy output, as with the Qwen3 draft."""
    proc = subprocess.run([LOADPLAN, "demo", "--draft", "nextn", "--dir", str(tmp_path / "out"), "--no-progress",
                           "--max-new-tokens", str(DEMO_MAX_NEW_TOKENS)],
                          capture_output=True, text=True, timeout=200, env=clean_env())
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    plans = _plans(tmp_path / "out" / "loadplan.db")
    by_role = {role: [p for p in plans if p["role"] == role] for role in ("target", "speculative")}
    assert {p["entry_class"] for p in by_role["speculative"]} == {"DeepseekV3ForCausalLMNextN"}
    assert {p["ep_rank"] for p in by_role["speculative"]} == {0, 1}
    for p in plans:
        assert p["decisions"]["moe.shared_experts_fusion"][0] is True
        assert p["decisions"]["moe.fused_shared_expert_scale"][0] == 0.5
    assert {tuple(p["decisions"]["pp.layer_range"][0]) for p in by_role["target"]} == {(0, 3)}
    assert {tuple(p["decisions"]["pp.layer_range"][0]) for p in by_role["speculative"]} == {(3, 4)}
    diff = proc.stdout[proc.stdout.index("audit diff"):]
    decision_rows = diff.split("\n\n")[0].splitlines()[1:]     # after the step's own line: the decisions' table
    assert [row.split()[0] for row in decision_rows] == ["KEY", "model.family", "pp.layer_range"], diff
    assert _output_tokens(proc.stdout) == _output_tokens(demo[1].stdout)
    rate = re.search(r"draft acceptance ([\d.]+) \((\d+)/(\d+) proposed", proc.stdout)
    assert rate and float(rate.group(1)) > 0.2, proc.stdout


def test_demo_refuses_an_unknown_draft():
    proc = subprocess.run([LOADPLAN, "demo", "--draft", "llama"], capture_output=True, text=True, timeout=60,
                          env=clean_env())
    assert proc.returncode == 2
    assert "--draft" in proc.stderr and "nextn" in proc.stderr and "qwen3" in proc.stderr
