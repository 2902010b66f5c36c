"""loadplan's SGLang adapter (issue 31), tested without a GPU.

SGLang 0.5.23's own modules run in their environment (`.venv-sglang`, DESIGN 8.4, made
by `make sglang-env`), with the device emulated; tests/integrations/sglang_runner.py
starts runners there as SGLang's scheduler does and calls the real
`resolve_shared_experts_config` through the name SGLang's loader calls. The registry is
the real server (EmbeddedRegistry on SQLite) in this process. The two SGLang processes
start at once (each pays SGLang's ~15 s import), one installing the adapter in-process and
one started by `loadplan sglang-run`, and are read by the tests below.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadplan.client import RegistryClient
from loadplan.integrations import sglang as adapter
from loadplan.integrations import sglang_run
from loadplan.plan import Keys
from loadplan.service.embedded import EmbeddedRegistry

pytestmark = pytest.mark.heavy(20)

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
# SGLang 0.5.22, profiled, whose loader step is install_shared_experts_fusion_decision; 0.5.19, without a profile
SGLANG_0522_PY = ROOT / ".venv-sglang-0.5.22" / "bin" / "python"
SGLANG_0519_PY = ROOT / ".venv-sglang-0.5.19" / "bin" / "python"
RUNNER = ROOT / "tests" / "integrations" / "sglang_runner.py"
LOADPLAN = Path(sys.executable).parent / "loadplan"
CLOSED_PORT = "127.0.0.1:9"   # discard port: nothing listens on loopback


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    db = tmp_path_factory.mktemp("sglang-adapter") / "registry.db"
    with EmbeddedRegistry(f"sqlite:///{db}") as reg:
        yield reg


@pytest.fixture(scope="module")
def runs(registry):
    """Start the SGLang processes together; {name: [runner records], ...} plus their output."""
    for python in (SGLANG_PY, SGLANG_0522_PY, SGLANG_0519_PY):
        if not python.exists():
            pytest.skip(f"{python} missing: `make sglang-env` makes SGLang's environments (`make test` does)")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    starts = {
        # in-process install(): DeepSeek-V3 tp 2 x ep 2 with a Qwen3 draft (4 targets, 4 drafts);
        # a hazard the registry refuses; then no registry at all (retried, then the start stops)
        "install": [str(SGLANG_PY), str(RUNNER),
                    "--run", f"dsv3_with_qwen3_draft:dsv3-draft@{registry.address}",
                    "--run", f"kimi_k2_enforced:kimi-hazard@{registry.address}",
                    "--run", f"dsv3_tp8:nowhere@{CLOSED_PORT}",
                    # two pipeline stages: SGLang's default partition, then SGLANG_PP_LAYER_PARTITION's
                    "--run", f"dsv3_pp2:dsv3-pp2@{registry.address}",
                    "--run", f"dsv3_pp2_default_partition:dsv3-pp2-default@{registry.address}",
                    "--run", f"dsv3_pp2_partition:dsv3-pp2-partition@{registry.address}",
                    "--run", f"qwen3_next_tp8:qwen3-next@{registry.address}"],
        # `loadplan sglang-run` starts the process: the adapter must be active without install()
        "sglang_run": [str(LOADPLAN), "sglang-run", "--registry", registry.address, "--deployment", "dsv3-run",
                       "--timeout", "20", "--", str(SGLANG_PY), str(RUNNER), "--run", "dsv3_tp8:dsv3-run"],
        # SGLang 0.5.22 under sglang-run: the adapter hooks that release's install_shared_experts_fusion_decision
        "sglang_run_0522": [str(LOADPLAN), "sglang-run", "--registry", registry.address, "--deployment",
                            "dsv3-0522", "--timeout", "20", "--", str(SGLANG_0522_PY), str(RUNNER), "--run",
                            "dsv3_tp8:dsv3-0522"],
        # SGLang 0.5.19, a release without a profile, under sglang-run: it starts and leaves an observed plan; then
        # in-process, a layout the registry knows for a hazard is still refused
        "sglang_run_0519": [str(LOADPLAN), "sglang-run", "--registry", registry.address, "--deployment",
                            "dsv3-0519", "--timeout", "20", "--", str(SGLANG_0519_PY), str(RUNNER), "--run",
                            "dsv3_tp8:dsv3-0519", "--run", f"kimi_k2_enforced:kimi-0519@{registry.address}"],
    }
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                    cwd=ROOT) for name, cmd in starts.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        records = [json.loads(line[len("RUNNER "):]) for line in stdout.splitlines() if line.startswith("RUNNER ")]
        assert proc.returncode == 0, stderr[-3000:]
        out[name] = {"records": records, "stderr": stderr[-3000:]}
    return out


def _scenario(runs, name, scenario):
    records = [r for r in runs[name]["records"] if r["scenario"] == scenario]
    assert records, runs[name]["stderr"]
    return records


def _plans(registry, deployment):
    with RegistryClient(registry.address) as client:
        plans, _ = client.list_plans(deployment_id=deployment, page_size=100)
    return plans


def test_target_and_draft_runners_get_the_registrys_decisions(runs, registry):
    records = _scenario(runs, "install", "dsv3_with_qwen3_draft")
    assert [(r["world_rank"], r["role"]) for r in records] == [
        (w, role) for w in range(4) for role in ("target", "speculative")]
    for r in records:
        assert "stopped" not in r, r
        assert r["adapter_active"] is True
        assert r["type"] == "sglang.srt.configs.shared_experts.SharedExpertsConfig"
    plans = _plans(registry, "dsv3-draft")
    # One plan per runner, with the role and ranks SGLang's state gave it.
    assert len(plans) == 8
    by_runner = {(p.request.role, p.request.parallel.tp_rank, p.request.parallel.ep_rank): p for p in plans}
    assert set(by_runner) == {(role, t, e) for role in ("target", "speculative") for t in (0, 1) for e in (0, 1)}
    for p in plans:
        assert (p.request.parallel.tp_size, p.request.parallel.ep_size) == (2, 2)
        assert p.request.runtime.engine == "sglang" and p.request.runtime.device == "cuda:9.0"
    targets = [p for p in plans if p.request.role == "target"]
    drafts = [p for p in plans if p.request.role == "speculative"]
    assert {p.entry_class for p in targets} == {"DeepseekV3ForCausalLM"}
    assert {p.entry_class for p in drafts} == {"Qwen3ForCausalLM"}
    # What each runner got from SGLang's function is its plan's decision.
    for r in records:
        sglang_world = r["world_rank"]
        # SGLang tp 4 = loadplan tp 2 x ep 2: moe_ep_rank = world // 2, moe_tp_rank = world % 2
        plan = by_runner[(r["role"], sglang_world % 2, sglang_world // 2)]
        fused = plan.value(Keys.SHARED_EXPERTS_FUSION)
        assert r["fusion_disabled"] is (not fused)
        assert r["num_fused_shared_experts"] == (plan.value(Keys.NUM_FUSED_SHARED_EXPERTS) if fused else 0)


def test_a_block_that_fuses_itself_is_planned_fused_and_the_loader_gets_sglangs_own_answer(runs, registry):
    """Qwen3-Next's Qwen2-MoE block fuses its shared expert on CUDA while it is built; its class has no loader hooks,
    so SGLang's own resolve_shared_experts_config answers no fused slots (not disabled, 0), and so must the adapter."""
    (record,) = _scenario(runs, "install", "qwen3_next_tp8")
    assert "stopped" not in record, record
    assert record["entry_class"] == "Qwen3NextForCausalLM"
    assert (record["fusion_disabled"], record["num_fused_shared_experts"]) == (False, 0)
    (plan,) = _plans(registry, "qwen3-next")
    fused = plan.decisions[Keys.SHARED_EXPERTS_FUSION]
    assert fused.value is True and fused.rule == "sglang.block.qwen2_moe.fused"


def test_the_draft_does_not_change_the_targets_plan(runs, registry):
    _scenario(runs, "install", "dsv3_with_qwen3_draft")
    plans = _plans(registry, "dsv3-draft")
    targets = [p for p in plans if p.request.role == "target"]
    wide = {k for k, d in targets[0].decisions.items() if d.deployment_wide}
    for p in targets[1:]:
        assert {k: p.decisions[k].value for k in wide} == {k: targets[0].decisions[k].value for k in wide}
    # The same target shape asked with no draft at all decides the same.
    from loadplan.service.rules.resolve import resolve_decisions

    alone = resolve_decisions(targets[0].request)
    for k in (Keys.SHARED_EXPERTS_FUSION, Keys.FORWARD_PATH, Keys.POST_EXPERTS_ALL_REDUCE):
        assert alone.decisions[k].value == targets[0].decisions[k].value


def test_a_hazard_stops_the_runners_start_with_the_registrys_message(runs, registry):
    (record,) = _scenario(runs, "install", "kimi_k2_enforced")
    assert record["adapter_active"] is True
    assert "fusion_disabled" not in record
    assert record["stopped"].startswith("LoadPlanRefused: loadplan registry refused the target runner of "
                                        "deployment kimi-hazard: FAILED_PRECONDITION: hazard:"), record
    assert _plans(registry, "kimi-hazard") == []


def test_an_unreachable_registry_stops_the_start_after_retries(runs):
    (record,) = _scenario(runs, "install", "dsv3_tp8")
    assert record["stopped"].startswith(f"LoadPlanRefused: loadplan registry at {CLOSED_PORT} is unreachable "
                                        "after the client's retries"), record
    assert "fusion_disabled" not in record


@pytest.mark.parametrize("scenario, deployment", [("dsv3_pp2", "dsv3-pp2"),
                                                  ("dsv3_pp2_default_partition", "dsv3-pp2-default")])
def test_each_pipeline_stage_is_planned_the_layers_sglang_builds_there(runs, registry, scenario, deployment):
    """Without SGLANG_PP_LAYER_PARTITION, or with one that spells out SGLang's default stages."""
    records = _scenario(runs, "install", scenario)
    assert [r["pp_rank"] for r in records] == [0, 1] and not any("stopped" in r for r in records)
    planned = {p.request.parallel.pp_rank: p.value(Keys.PP_LAYER_RANGE) for p in _plans(registry, deployment)}
    assert planned == {r["pp_rank"]: r["sglang_layer_range"] for r in records}


def test_a_layer_partition_the_registry_cannot_plan_stops_each_stage_naming_it(runs, registry):
    """SGLANG_PP_LAYER_PARTITION moves SGLang's stage boundaries; the registry plans the default
    ones, so a plan would record layers the runner does not hold: the runner does not start."""
    records = _scenario(runs, "install", "dsv3_pp2_partition")
    planned = {p.request.parallel.pp_rank: p.value(Keys.PP_LAYER_RANGE) for p in _plans(registry, "dsv3-pp2-partition")}
    assert len(records) == 2 and len(planned) == 2
    for r in records:
        built, plan = r["sglang_layer_range"], planned[r["pp_rank"]]
        assert built != plan
        assert r["stopped"].startswith("LoadPlanRefused: ")
        assert "SGLANG_PP_LAYER_PARTITION='20,41'" in r["stopped"]
        assert f"[{plan[0]}, {plan[1]})" in r["stopped"] and f"[{built[0]}, {built[1]})" in r["stopped"]


def test_a_process_started_by_sglang_run_has_the_adapter_active(runs, registry):
    (record,) = _scenario(runs, "sglang_run", "dsv3_tp8")
    assert record["adapter_active"] is True
    assert "stopped" not in record, record
    (plan,) = _plans(registry, "dsv3-run")
    assert plan.request.role == "target" and plan.entry_class == "DeepseekV3ForCausalLM"
    assert plan.request.parallel.tp_size == 8 and plan.request.runtime.engine_version == "0.5.23"
    assert record["fusion_disabled"] is (not plan.value(Keys.SHARED_EXPERTS_FUSION))
    assert f"loadplan plan {plan.plan_id} for target DeepseekV3ForCausalLM" in runs["sglang_run"]["stderr"]


def test_sglang_0_5_22s_own_loader_step_asks_the_registry(runs, registry):
    (record,) = _scenario(runs, "sglang_run_0522", "dsv3_tp8")
    assert record["adapter_active"] is True and record["step"] == "install_shared_experts_fusion_decision"
    assert "stopped" not in record, record
    (plan,) = _plans(registry, "dsv3-0522")
    assert plan.request.runtime.engine_version == "0.5.22" and not plan.observed
    assert plan.decisions[Keys.ENGINE_PROFILE].value == "sglang 0.5.22"
    fused = plan.value(Keys.SHARED_EXPERTS_FUSION)
    # the flag the registry installed is what the model counts its fused experts from
    assert record["fusion_disabled"] is (not fused)
    assert record["num_fused_shared_experts"] == (plan.value(Keys.NUM_FUSED_SHARED_EXPERTS) if fused else 0)


def test_a_release_without_a_profile_starts_and_leaves_an_observed_plan(runs, registry):
    (record,) = _scenario(runs, "sglang_run_0519", "dsv3_tp8")
    assert record["adapter_active"] is True and "stopped" not in record, record
    (plan,) = _plans(registry, "dsv3-0519")
    assert plan.observed and plan.request.runtime.engine_version == "0.5.19"
    assert plan.decisions[Keys.ENGINE_PROFILE].value == "sglang 0.5.19 (observed)"
    fused = plan.decisions[Keys.SHARED_EXPERTS_FUSION]
    # what SGLang 0.5.19's own step decided is what the plan records
    assert fused.rule == "observed.sglang" and fused.value is (not record["fusion_disabled"])
    assert "OBSERVED" in runs["sglang_run_0519"]["stderr"]


def test_a_hazard_the_registry_knows_stops_an_unprofiled_release_too(runs, registry):
    (record,) = _scenario(runs, "sglang_run_0519", "kimi_k2_enforced")
    assert record["stopped"].startswith("LoadPlanRefused: loadplan registry refused the target runner of "
                                        "deployment kimi-0519: FAILED_PRECONDITION: hazard:"), record
    assert "nearest profiled release" in record["stopped"]
    assert _plans(registry, "kimi-0519") == []


# --- without SGLang's modules ------------------------------------------------------


def test_install_refuses_only_a_release_without_the_loader_step_it_hooks():
    with pytest.raises(adapter.SglangVersionError, match=r"from 0\.5\.18; this is sglang 0\.5\.17"):
        adapter.check_version("0.5.17")
    for version in ("0.5.18", "0.5.22", "0.5.23", "0.5.24", "0.6.0rc1"):
        assert adapter.check_version(version) == version


def test_the_start_up_hook_stops_a_process_with_an_unknown_sglang(tmp_path):
    # A Python whose sglang says 0.5.17 (a bare dist-info is all importlib.metadata reads).
    dist = tmp_path / "sglang-0.5.17.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.17\n")
    args = argparse.Namespace(
        registry="127.0.0.1:1", deployment="d", token=None, timeout=None, allow_fallback=False)
    env = sglang_run.environment(args, base={"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path)})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(sglang_run.BOOT_DIR), str(tmp_path)]
    assert env[adapter.ENV_ACTIVE] == "1" and env[adapter.ENV_REGISTRY] == "127.0.0.1:1"
    proc = subprocess.run([sys.executable, "-c", "print('started')"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "has from 0.5.18; this is sglang 0.5.17" in proc.stderr
    assert "started" not in proc.stdout
    # Without LOADPLAN_SGLANG the hook does nothing.
    env.pop(adapter.ENV_ACTIVE)
    proc = subprocess.run([sys.executable, "-c", "print('started')"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "started"


def test_sglang_run_needs_a_command_and_a_registry():
    run = subprocess.run([str(LOADPLAN), "sglang-run", "--registry", "127.0.0.1:1"], capture_output=True, text=True)
    assert run.returncode != 0 and "command: nothing to run" in run.stderr
    env = {k: v for k, v in os.environ.items() if k != adapter.ENV_REGISTRY}
    run = subprocess.run([str(LOADPLAN), "sglang-run", "--", "true"], capture_output=True, text=True, env=env)
    assert run.returncode != 0 and "--registry: an address is needed" in run.stderr


def test_the_compose_sglang_worker_runs_sglang_under_sglang_run():
    import yaml

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    svc = services["sglang-worker"]
    argv = [str(a) for a in svc["command"]]
    assert argv[:2] == ["loadplan", "sglang-run"]
    assert argv[argv.index("--registry") + 1] == "registry:50051"
    assert argv[argv.index("--") + 1:argv.index("--") + 4] == ["python3", "-m", "sglang.launch_server"]
    assert svc["depends_on"]["registry"]["condition"] == "service_healthy"
    assert svc["profiles"] == ["sglang"]      # needs GPUs: only when asked for
    assert svc["build"]["dockerfile"] == "Dockerfile.sglang"
    dockerfile = (ROOT / "Dockerfile.sglang").read_text()
    assert "--no-deps ." in dockerfile and "check_version()" in dockerfile
