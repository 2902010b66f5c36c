"""The registry's sglang profile against SGLang 0.5.23's own decision code (issue 30).

Every point recorded by scripts/record_sglang_grid.py must agree (or be a listed hazard,
or both refuse), and a random sample of the recording is re-run live through SGLang's
code (tests/conformance/sglang_oracle.py in the SGLang environment) so that the recording
cannot drift from the code it came from. LOADPLAN_CONFORMANCE_SEED=N replays a sample.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time

import pytest

from .sglang_agreement import (RECORDING, ROOT, load_recording, point_name, report, summarize, verdict)

SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
ORACLE = ROOT / "tests" / "conformance" / "sglang_oracle.py"
LIVE_SAMPLE = 16
DEVICES = {"cuda:8.0", "cuda:9.0", "cuda:10.0", "hip:9.4"}
# The volatile part of an answer: how long SGLang took.
VOLATILE = {"seconds"}


@pytest.fixture(scope="module")
def recording():
    assert RECORDING.is_file(), f"{RECORDING} missing: run scripts/record_sglang_grid.py"
    return load_recording()


def test_recording_names_its_sglang_and_covers_the_grid(recording):
    header, records = recording
    assert header["sglang"] == "0.5.23"
    assert header["script"] == "scripts/record_sglang_grid.py"
    assert header["points"] == len(records)
    points = [r["point"] for r in records]
    assert {p["device"] for p in points} == DEVICES
    main = [p for p in points if p["grid"] == "main"]
    assert {p["a2a_backend"] for p in main} == set(header["inputs"]["a2a_backends"])
    assert len({(p["tp"], p["ep"], p.get("dp", 1)) for p in main}) == 3
    real_configs = {d.name for d in (ROOT / "tests" / "data" / "configs").iterdir() if (d / "config.json").is_file()}
    assert real_configs <= {p["config"] for p in main}, "every real config in tests/data/configs is on the grid"
    assert any(p.get("sbo") for p in main) and any(p.get("tbo") for p in main)
    assert any(p.get("enforce_fusion") for p in main) and any(p.get("disable_fusion") for p in main)
    assert {g for g in (p["grid"] for p in points)} >= {"main", "runner", "pipeline", "eplb", "draft"}
    assert not [r for r in records if "error" in r["answer"]], "the oracle answered every point"
    # The recording is SGLang's, not a constant: it both fuses and refuses somewhere.
    answers = [r["answer"] for r in records]
    assert any(a.get("shared_experts_fusion") for a in answers)
    assert any(a.get("refused") for a in answers)
    assert {a.get("forward_path") for a in answers} >= {"normal", "a2a"}


def test_registry_agrees_with_sglang_on_every_recorded_point(recording):
    _, records = recording
    kinds, failures = summarize(records)
    summary = report(records, kinds, failures, show=30)
    print(summary)
    assert not failures, summary


def _a_point(records, **want):
    return next(r for r in records if all(r["point"].get(k) == v for k, v in want.items()))


def test_a_point_sglang_refuses_agrees_only_when_the_registry_refuses(recording):
    _, records = recording
    rec = _a_point(records, grid="main", config="deepseek-v3", device="cuda:9.0", a2a_backend="none",
                   tp=8, ep=1)
    assert not rec["answer"]["refused"]
    refusing = dict(rec["answer"], refused=True, stage="server_args", message="AssertionError: no")
    v = verdict(rec["point"], refusing)
    assert not v.agrees and v.kind == "SGLang refuses, registry answers", v


def test_a_point_differing_in_fusion_names_the_key(recording):
    _, records = recording
    rec = _a_point(records, grid="main", config="deepseek-v3", device="cuda:9.0", a2a_backend="none",
                   tp=8, ep=1)
    honest = verdict(rec["point"], rec["answer"])
    flipped = dict(rec["answer"], shared_experts_fusion=not rec["answer"]["shared_experts_fusion"])
    v = verdict(rec["point"], flipped)
    if honest.agrees:
        assert not v.agrees and "moe.shared_experts_fusion" in v.kind
    else:   # the registry already differed: flipping SGLang's answer must change the verdict
        assert v.differences != honest.differences


def test_the_recording_is_what_sglang_answers_now(recording):
    """Re-run SGLang's own code on a random sample of one device's recorded points."""
    if not SGLANG_PY.exists():
        pytest.skip(f"{SGLANG_PY} missing: `make sglang-env` makes SGLang's environment (`make test` does)")
    _, records = recording
    seed = int(os.environ.get("LOADPLAN_CONFORMANCE_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    device = rng.choice(sorted(DEVICES))
    pool = [r for r in records if r["point"]["device"] == device]
    sample = rng.sample(pool, min(LIVE_SAMPLE, len(pool)))
    feed = "".join(json.dumps(r["point"]) + "\n" for r in sample)
    proc = subprocess.run([str(SGLANG_PY), str(ORACLE), "--device", device], input=feed,
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    ready, live = lines[0], lines[1:]
    assert ready["sglang"] == "0.5.23"
    assert len(live) == len(sample)
    drifted = []
    for rec, now in zip(sample, live):
        assert now["point"] == rec["point"]
        old = {k: v for k, v in rec["answer"].items() if k not in VOLATILE}
        new = {k: v for k, v in now["answer"].items() if k not in VOLATILE}
        if old != new:
            keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
            drifted.append(f"{point_name(rec['point'])}: {', '.join(f'{k} {old.get(k)!r} -> {new.get(k)!r}' for k in keys)}")
    assert not drifted, f"seed {seed}: the recording differs from SGLang's code:\n" + "\n".join(drifted)


def test_point_names_are_unique(recording):
    _, records = recording
    names = [point_name(r["point"]) for r in records]
    assert len(set(names)) == len(names)


def test_requests_map_tp_ep_and_stage_ranks(recording):
    from .sglang_agreement import requests_for

    _, records = recording
    rec = _a_point(records, grid="pipeline", config="deepseek-v3", pp=4)
    reqs = requests_for(rec["point"], rec["answer"])
    assert [r.parallel.pp_rank for r in reqs] == [0, 1, 2, 3]
    assert {(r.parallel.tp_size, r.parallel.ep_size, r.runtime.engine) for r in reqs} == {(8, 1, "sglang")}
    draft = _a_point(records, grid="draft", config="deepseek-v3", draft_config="deepseek-v3")
    (req,) = requests_for(draft["point"], draft["answer"])
    assert req.role == "speculative"
    assert req.config["architectures"] == ["DeepseekV3ForCausalLMNextN"]
