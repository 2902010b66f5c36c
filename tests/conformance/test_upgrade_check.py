"""`upgrade-check` over a history of deployments on SGLang 0.5.22: what it names for 0.5.23 is what the two
releases' own code decide.

The deployments are grid points where the two recordings differ (a forward path that changes, a checkpoint 0.5.23
refuses) and one where they agree; each is resolved on 0.5.22 into a real store, then checked against 0.5.23. The
report must name exactly the decisions whose SGLang answers differ between the two recordings, and the two
releases' code is re-run live on those points (each in its own environment) to show the recordings are what that
code answers now.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest

from loadplan.plan import Decision, Keys, LoadPlan, Parallel, ResolveRequest, Runtime
from loadplan.service.registry import Registry
from loadplan.service.store.db import make_engine
from loadplan.service.store.repository import SqlPlanStore
from loadplan.service.upgrade_check import check_upgrade
from loadplan.upgrade import CHANGES, HAZARD, REFUSED, UNCHANGED

from .sglang_agreement import ROOT, load_recording, recording_of, requests_for

ORACLE = ROOT / "tests" / "conformance" / "sglang_oracle.py"
FROM, TO = "0.5.22", "0.5.23"
# name -> the grid point it is deployed from
POINTS = {
    "qwen2-fuseep": {"a2a_backend": "ascend_fuseep", "config": "qwen1.5-moe-a2.7b", "device": "cuda:10.0",
                     "disable_fusion": True, "dp": 1, "ep": 1, "grid": "main", "tp": 8},
    "m3-megamoe": {"a2a_backend": "megamoe", "config": "tiny-minimax-m3", "device": "cuda:10.0", "dp": 1, "ep": 1,
                   "grid": "blocks", "tp": 8},
    "m3-nvfp4": {"a2a_backend": "ascend_fuseep", "config": "tiny-minimax-m3-nvfp4", "device": "cuda:10.0", "dp": 1,
                 "ep": 1, "grid": "blocks", "tp": 8},
    "dsv3-steady": {"a2a_backend": "none", "config": "deepseek-v3", "device": "cuda:9.0", "dp": 1, "ep": 1,
                    "grid": "main", "tp": 8},
}
# The answer fields of the oracle and the decisions they are
ANSWERED = {"shared_experts_fusion": Keys.SHARED_EXPERTS_FUSION, "forward_path": Keys.FORWARD_PATH,
            "post_experts_all_reduce": Keys.POST_EXPERTS_ALL_REDUCE}


def _answers(release: str) -> dict[str, dict]:
    _, records = load_recording(recording_of(release))
    by_point = {json.dumps(r["point"], sort_keys=True): r["answer"] for r in records}
    return {name: by_point[json.dumps(p, sort_keys=True)] for name, p in POINTS.items()}


@pytest.fixture(scope="module")
def answers():
    return {release: _answers(release) for release in (FROM, TO)}


@pytest.fixture(scope="module")
def report(tmp_path_factory, answers):
    from loadplan.service.store.db import migrate

    url = f"sqlite:///{tmp_path_factory.mktemp('upgrade') / 'history.db'}"
    migrate(url)
    engine = make_engine(url)
    registry = Registry(SqlPlanStore(engine))
    for name, point in POINTS.items():
        (req,) = requests_for(point, answers[FROM][name], FROM)
        registry.resolve(replace(req, request_id=f"{name}-r0", deployment_id=name))
    yield registry.upgrade_check("sglang", TO, FROM)
    engine.dispose()


def test_the_history_is_on_the_old_release(answers):
    assert not any(a.get("refused") for a in answers[FROM].values())


def test_upgrade_check_names_what_the_two_releases_code_decides(report, answers):
    by_name = {d.deployment_id: d for d in report.deployments}
    assert set(by_name) == set(POINTS)
    assert all(d.from_versions == (FROM,) for d in by_name.values())
    for name, deployment in by_name.items():
        (role,) = deployment.roles
        old, new = answers[FROM][name], answers[TO][name]
        if new.get("refused"):
            assert deployment.status == REFUSED and not role.hazard, name
            assert new["message"].split(": ", 1)[1] in role.refusal, (name, role.refusal)
            continue
        differing = {ANSWERED[k] for k in ANSWERED if old.get(k) != new.get(k)}
        if (old["rewritten"] or {}).get("moe_runner_backend") != (new["rewritten"] or {}).get("moe_runner_backend"):
            differing.add("sglang.moe_runner_backend")
        changed = {c.key for c in role.changes}
        assert differing <= changed, (name, differing, changed)
        for change in role.changes:
            if change.key in ANSWERED.values():
                field = next(k for k, v in ANSWERED.items() if v == change.key)
                assert (change.before.value, change.after.value) == (old[field], new[field]), (name, change)
                assert change.before.rule != change.after.rule or change.before.reason != change.after.reason
        assert deployment.status == (CHANGES if differing else UNCHANGED), (name, role.changes)
    assert by_name["dsv3-steady"].status == UNCHANGED
    assert by_name["qwen2-fuseep"].status == CHANGES
    assert report.blocked          # m3-nvfp4 is refused on 0.5.23


@pytest.mark.parametrize("release", [FROM, TO])
def test_the_recorded_answers_are_what_each_releases_code_answers_now(release, answers):
    from .test_sglang_conformance import VOLATILE, environment

    python = environment(release) / "bin" / "python"
    assert python.exists(), f"{python} missing: `make sglang-env` builds it"
    for device in sorted({p["device"] for p in POINTS.values()}):
        names = [n for n, p in POINTS.items() if p["device"] == device]
        proc = subprocess.run([str(python), str(ORACLE), "--device", device],
                              input="".join(json.dumps(POINTS[n]) + "\n" for n in names),
                              capture_output=True, text=True, timeout=240, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]
        live = [json.loads(line)["answer"] for line in proc.stdout.splitlines()[1:] if line.strip()]
        for name, now in zip(names, live):
            strip = lambda a: {k: v for k, v in a.items() if k not in VOLATILE}   # noqa: E731
            assert strip(now) == strip(answers[release][name]), (release, name)


def _stored(point: dict, version: str) -> LoadPlan:
    """A plan stored for `point` by release `version`: its request, any decisions."""
    (req,) = requests_for(point, {})
    req = replace(req, deployment_id=point["config"], runtime=replace(req.runtime, engine_version=version))
    return LoadPlan(f"plan-{point['config']}", "r", req, "x", "fp", None,
                    {Keys.FORWARD_PATH: Decision(Keys.FORWARD_PATH, "normal", "stored", "stored.rule")})


def test_a_runner_the_target_release_would_plan_into_a_hazard_blocks_the_upgrade():
    """The Qwen2-MoE block on mooncake over SGLang's tp group of 8 takes its normal branch, whose all-reduce follows
    the experts layer's combine (a double reduction): a stored plan of that deployment is reported as a hazard."""
    hazardous = _stored({"a2a_backend": "mooncake", "config": "qwen1.5-moe-a2.7b", "device": "cuda:9.0", "dp": 1,
                         "ep": 1, "grid": "main", "tp": 8}, "0.5.21")
    steady = _stored(POINTS["dsv3-steady"], "0.5.21")
    report = check_upgrade([hazardous, steady], "sglang", TO)
    status = {d.deployment_id: d.status for d in report.deployments}
    assert status == {"qwen1.5-moe-a2.7b": HAZARD, "deepseek-v3": CHANGES} and report.blocked
    role = next(d for d in report.deployments if d.status == HAZARD).roles[0]
    assert role.refusal.startswith("FAILED_PRECONDITION: hazard: sglang.double_reduction") and role.refused_runners == 1


def test_unknown_releases_and_engines_are_named():
    from loadplan.errors import InvalidArgument, NotFound

    with pytest.raises(NotFound, match="0.5.20, 0.5.21, 0.5.22, 0.5.23") as e:
        check_upgrade([], "sglang", "0.5.99")
    assert e.value.field == "to_version"
    with pytest.raises(NotFound) as e:
        check_upgrade([], "sglang", TO, "0.5.1")
    assert e.value.field == "from_version"
    with pytest.raises(NotFound) as e:
        check_upgrade([], "trt-llm", TO)
    assert e.value.field == "engine"
    with pytest.raises(InvalidArgument):
        check_upgrade([], "sglang", TO, TO)
