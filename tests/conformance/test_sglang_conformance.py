"""The registry's sglang profile against SGLang 0.5.23's own decision code (issue 30).

Every point recorded by scripts/record_sglang_grid.py must agree (sglang_agreement.py: the decisions equal, the MoE
runner included; both refuse, the registry in SGLang's own words; or a hazard SGLang's own answer shows), the
recording must be exactly the script's grid, and a random sample from every sub-grid is re-run live through SGLang's
code (tests/conformance/sglang_oracle.py in the SGLang environment) so that the recording cannot drift from the code
it came from. LOADPLAN_CONFORMANCE_SEED=N replays a sample.
"""

from __future__ import annotations

import collections
import concurrent.futures
import importlib.util
import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from loadplan.errors import RegistryError
from loadplan.service.rules.resolve import resolve_decisions

from .sglang_agreement import (RECORDING, RELEASES, ROOT, load_recording, oracle_args, point_name, recording_of,
                               report,
                               requests_for, summarize, verdict)

ORACLE = ROOT / "tests" / "conformance" / "sglang_oracle.py"
GRID_SCRIPT = ROOT / "scripts" / "record_sglang_grid.py"
LIVE_PER_GRID = 3
DEVICES = {"cuda:8.0", "cuda:9.0", "cuda:10.0", "hip:9.4", "hip:9.5"}   # hip:9.5: the engine_env sub-grid's
ALWAYS_LIVE = "cuda:9.0"     # the pipeline, eplb and entries sub-grids are recorded on it alone
# The volatile part of an answer: how long SGLang took.
VOLATILE = {"seconds"}


def environment(release: str) -> Path:
    """The release's SGLang environment (the Makefile's sglang-env), as the grid script names it."""
    return _grid_script().environment(release)


@pytest.fixture(scope="module")
def recording():
    """The newest release's recording: what the verdict's own tests perturb."""
    assert RECORDING.is_file(), f"{RECORDING} missing: run scripts/record_sglang_grid.py"
    return load_recording()


@pytest.fixture(scope="module", params=sorted(RELEASES))
def release_recording(request):
    """(release, header, records) of every profiled SGLang release."""
    path = recording_of(request.param)
    assert path.is_file(), f"{path} missing: run scripts/record_sglang_grid.py --release {request.param}"
    return (request.param, *load_recording(path))


_SUMMARIES: dict = {}


def summary_of(release: str, records: list[dict]):
    """(kinds, failures) of a release's recording, computed once per session (a few seconds each)."""
    if release not in _SUMMARIES:
        _SUMMARIES[release] = summarize(records, release)
    return _SUMMARIES[release]


def test_recording_names_its_sglang_and_covers_the_grid(release_recording):
    release, header, records = release_recording
    assert header["sglang"] == release
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


def test_registry_agrees_with_sglang_on_every_recorded_point(release_recording):
    release, _, records = release_recording
    kinds, failures = summary_of(release, records)
    summary = report(records, kinds, failures, show=30, release=release)
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


def _grid_script():
    spec = importlib.util.spec_from_file_location("record_sglang_grid", GRID_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_recording_is_exactly_the_grid_scripts_grid(release_recording):
    """Every point the grid script makes is recorded, once, and nothing else: a point added to the script and not
    recorded (or left over from an older grid) fails here."""
    release, _, records = release_recording
    key = lambda p: json.dumps(p, sort_keys=True)   # noqa: E731
    recorded = [key(r["point"]) for r in records]
    assert len(set(recorded)) == len(recorded), "a point recorded twice"
    script = {key(p) for p in _grid_script().grid()}
    assert set(recorded) == script, (f"{len(script - set(recorded))} grid points not recorded, "
                                     f"{len(set(recorded) - script)} recorded points not on the grid: "
                                     f"rerun scripts/record_sglang_grid.py --release {release}")


def live_sample(records: list[dict], rng: random.Random) -> list[dict]:
    """A few random points of every sub-grid, on cuda:9.0 (where every sub-grid has points) and one other device;
    the engine_env sub-grid's from one random device and environment (each pair is an oracle process of its own)."""
    # the other device: one where sub-grids beside engine_env have points (hip:9.5 has only engine_env's)
    others = sorted({r["point"]["device"] for r in records if not r["point"].get("engine_env")} - {ALWAYS_LIVE})
    devices = {ALWAYS_LIVE, rng.choice(others)}
    env_runs = sorted({oracle_args(r["point"]) for r in records if r["point"].get("engine_env")})
    env_run = rng.choice(env_runs) if env_runs else None
    by_grid: dict[str, list[dict]] = {}
    for r in records:
        if r["point"].get("engine_env") and oracle_args(r["point"]) == env_run \
                or not r["point"].get("engine_env") and r["point"]["device"] in devices:
            by_grid.setdefault(r["point"]["grid"], []).append(r)
    return [r for grid in sorted(by_grid) for r in rng.sample(by_grid[grid], min(LIVE_PER_GRID, len(by_grid[grid])))]


def _run_oracle(release: str, args: tuple[str, ...], sample: list[dict]) -> list[dict]:
    feed = "".join(json.dumps(r["point"]) + "\n" for r in sample)
    proc = subprocess.run([str(environment(release) / "bin" / "python"), str(ORACLE), *args], input=feed,
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    ready, live = lines[0], lines[1:]
    assert ready["sglang"] == release
    assert len(live) == len(sample)
    return live


def test_the_recording_is_what_sglang_answers_now(release_recording):
    """Re-run each release's own code on a random sample drawn from every sub-grid (one oracle process per device)."""
    release, _, records = release_recording
    python = environment(release) / "bin" / "python"
    assert python.exists(), (f"{python} missing: `make sglang-env` builds SGLang {release}'s environment "
                             f"(`make test` does)")
    seed = int(os.environ.get("LOADPLAN_CONFORMANCE_SEED", time.time_ns() % 1_000_000))
    sample = live_sample(records, random.Random(seed))
    assert {r["point"]["grid"] for r in sample} == {r["point"]["grid"] for r in records}
    by_device: dict[tuple[str, ...], list[dict]] = {}
    for r in sample:      # one oracle process per device and environment
        by_device.setdefault(oracle_args(r["point"]), []).append(r)
    with concurrent.futures.ThreadPoolExecutor(len(by_device)) as pool:
        answers = dict(zip(by_device, pool.map(lambda d: _run_oracle(release, d, by_device[d]), by_device)))
    drifted = []
    for device, recs in by_device.items():
        for rec, now in zip(recs, answers[device]):
            assert now["point"] == rec["point"]
            old = {k: v for k, v in rec["answer"].items() if k not in VOLATILE}
            new = {k: v for k, v in now["answer"].items() if k not in VOLATILE}
            if old != new:
                keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
                drifted.append(f"{point_name(rec['point'])}: "
                               f"{', '.join(f'{k} {old.get(k)!r} -> {new.get(k)!r}' for k in keys)}")
    assert not drifted, f"seed {seed}: the recording differs from SGLang {release}'s code:\n" + "\n".join(drifted)


def test_the_live_sample_touches_every_sub_grid_and_two_devices(recording):
    _, records = recording
    for seed in range(5):
        sample = live_sample(records, random.Random(seed))
        assert {r["point"]["grid"] for r in sample} == {r["point"]["grid"] for r in records}
        assert len({r["point"]["device"] for r in sample if not r["point"].get("engine_env")}) == 2
        assert len({oracle_args(r["point"]) for r in sample}) <= 3      # two devices, one environment
        assert len(sample) <= LIVE_PER_GRID * len({r["point"]["grid"] for r in records})


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


def test_every_hazard_of_the_sglang_profile_has_a_check_of_sglangs_answer():
    from loadplan.service.rules.hazards import HAZARDS

    from .sglang_agreement import HAZARD_SHOWS

    assert set(HAZARD_SHOWS) == {h.id for h in HAZARDS.values() if h.engine == "sglang"}


def _refusing(rec, words):
    return dict(rec["answer"], refused=True, stage="server_args", message=f"ValueError: {words}")


def test_a_refusal_agrees_only_in_sglangs_words(recording):
    _, records = recording
    rec = _a_point(records, grid="main", config="deepseek-v3", device="cuda:9.0", a2a_backend="pplx", tp=8, ep=1)
    honest = verdict(rec["point"], rec["answer"])
    assert honest.agrees and honest.kind == "both refuse, in SGLang's words", honest
    v = verdict(rec["point"], _refusing(rec, "some other check SGLang failed first"))
    assert not v.agrees and v.kind == "both refuse, for another reason", v


def test_a_hazard_where_sglang_refuses_is_a_disagreement(recording):
    _, records = recording
    rec = next(r for r in records if verdict(r["point"], r["answer"]).kind == "hazard shown by SGLang's answer")
    v = verdict(rec["point"], _refusing(rec, "a start-up check"))
    assert not v.agrees and v.kind == "registry calls a hazard what SGLang refuses", v
    shown_nothing = dict(rec["answer"], forward_path="normal", post_experts_all_reduce=False,
                         shared_experts_fusion=False)
    v = verdict(rec["point"], shown_nothing)
    assert not v.agrees and v.kind == "registry claims a hazard SGLang's code does not run", v


def test_the_moe_runner_is_compared_on_every_point_sglang_runs(recording):
    _, records = recording
    rec = _a_point(records, grid="main", config="deepseek-v3", device="cuda:9.0", a2a_backend="none", tp=8, ep=1)
    assert rec["answer"]["rewritten"]["moe_runner_backend"] == "auto"
    other = dict(rec["answer"], rewritten=dict(rec["answer"]["rewritten"], moe_runner_backend="deep_gemm"))
    v = verdict(rec["point"], other)
    assert not v.agrees and "sglang.moe_runner_backend" in v.kind, v


def test_the_readme_gives_the_grids_counts_as_measured(recording):
    """The README's table of what the grid checks holds today's counts (points, per kind, per hazard)."""
    import re

    from .sglang_agreement import KIND_BOTH_REFUSE, KIND_EQUAL, KIND_HAZARD

    _, records = recording
    kinds, failures = summary_of(RECORDING.name.split("_")[1], records)
    assert not failures
    readme = (ROOT / "README.md").read_text()
    number = lambda text: int(text.replace(",", ""))   # noqa: E731
    table = {m[1]: number(m[0]) for m in re.findall(r"^\| ([\d,]+) (decisions equal|both refuse|hazards shown)",
                                                    readme, re.M)}
    assert table == {"decisions equal": kinds["agree: " + KIND_EQUAL],
                     "both refuse": kinds["agree: " + KIND_BOTH_REFUSE],
                     "hazards shown": kinds["agree: " + KIND_HAZARD]}
    assert f"| of {len(records):,} points |" in readme
    hazards = collections.Counter()
    for r in records:
        try:
            [resolve_decisions(q) for q in requests_for(r["point"], r["answer"])]
        except RegistryError as e:
            if e.message.startswith("hazard:"):
                hazards[e.message.split(":")[1].strip()] += 1
    shown = {"sglang.double_reduction": "a reduction owed after an a2a combine",
             "sglang.fused_global_slot_on_dispatch": "a fused slot on a dispatch path without per-rank slots",
             "sglang.enforced_384_without_quark": "an enforced 384-expert fusion without Quark"}
    for hazard, words in shown.items():
        assert f"{words}: {hazards[hazard]:,}" in readme, (hazard, hazards[hazard])


def test_the_readme_gives_each_releases_counts_as_measured(release_recording):
    import re

    from .sglang_agreement import KIND_BOTH_REFUSE, KIND_EQUAL, KIND_HAZARD

    release, _, records = release_recording
    kinds, failures = summary_of(release, records)
    assert not failures
    readme = (ROOT / "README.md").read_text()
    row = re.search(rf"^\| {re.escape(release)} \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|$", readme, re.M)
    assert row, f"README: no row for SGLang {release} in the table of releases"
    assert [int(n.replace(",", "")) for n in row.groups()] == [
        len(records), kinds["agree: " + KIND_EQUAL], kinds["agree: " + KIND_BOTH_REFUSE], kinds["agree: " + KIND_HAZARD]]
