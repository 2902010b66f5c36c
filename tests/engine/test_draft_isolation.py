"""Building a draft runner never changes its target (DESIGN 1: a draft that rewrote its target's decision).

One worker, one deployment, one registry: the target is a tiny DeepSeek-V3 (256 routed experts,
so the fusion gate fuses its shared expert under default flags); the draft is a runner of the
same engine class whose gate answers differently: a smaller DeepSeek-V3 (8 routed experts:
the gate's structural condition refuses fusion), the target's own checkpoint with another
fusion intent, or that checkpoint quantized to FP8 blocks with another intent (the two
checkpoints quantized differently, as in DESIGN 1). After the draft is built, the target's plan, every baked attribute of its layers,
its weights and its logits are what they were; the registry shows the two plans differ.
"""

from __future__ import annotations

import json

import pytest
import torch

from loadplan.cli.main import main
from loadplan.engine.loader import load_model
from loadplan.engine.speculative import speculative_generate
from loadplan.service.embedded import EmbeddedRegistry

from engine_helpers import DEEPSEEK_TINY, hf_reference, load_kwargs, make_fp8_copies, prompt, randomize

transformers = pytest.importorskip("transformers")

FUSION = "moe.shared_experts_fusion"
TINY = dict(DEEPSEEK_TINY, num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def make_deepseek(path, *, seed, **overrides):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**dict(TINY, **overrides)))
    randomize(model, seed)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return make_deepseek(tmp_path_factory.mktemp("target"), seed=0)


@pytest.fixture(scope="module")
def small_draft_path(tmp_path_factory):
    return make_deepseek(tmp_path_factory.mktemp("draft"), seed=1, n_routed_experts=8, n_group=1, topk_group=1,
                         num_experts_per_tok=2, num_hidden_layers=1)


@pytest.fixture(scope="module")
def fp8_draft_path(target_path, tmp_path_factory):
    """The target's checkpoint quantized to FP8 blocks: a draft of the same engine class, quantized differently."""
    return make_fp8_copies(target_path, tmp_path_factory.mktemp("fp8"), [16, 8])[0]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'plans.db'}"
    with EmbeddedRegistry(url) as reg, reg.client() as client:
        yield url, client


def baked(model: torch.nn.Module) -> dict[str, object]:
    """Every plain value a module of the model holds or sees (instance or class attribute)."""
    plain = (bool, int, float, str, type(None))
    out = {}
    for mname, module in model.named_modules():
        for name in dir(module):
            if name.startswith("_"):
                continue
            try:
                value = getattr(module, name)
            except Exception:  # noqa: BLE001 - a property that needs state it does not have
                continue
            if isinstance(value, plain) or (isinstance(value, tuple) and all(isinstance(v, plain) for v in value)):
                out[f"{mname}.{name}"] = value
    return out


def snapshot(model, ids):
    with torch.no_grad():
        logits = model(ids)
    decisions = {k: (d.value, d.reason, d.rule) for k, d in model.plan.plan.decisions.items()}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return model.plan, decisions, baked(model), weights, logits


DRAFTS = {
    "smaller-checkpoint": lambda paths: (paths["small"], {}),
    "other-fusion-intent": lambda paths: (paths["target"], {"disable_shared_experts_fusion": True}),
    # DESIGN 1's case: the two checkpoints quantized differently (the draft's FP8 weights are dequantized at load).
    "fp8-quantized-other-intent": lambda paths: (paths["fp8"], {"disable_shared_experts_fusion": True}),
}


@pytest.mark.parametrize("kind", list(DRAFTS))
def test_building_the_draft_leaves_the_target_untouched(kind, target_path, small_draft_path, fp8_draft_path, registry,
                                                        capsys):
    url, client = registry
    deployment = f"isolation-{kind}"
    draft_path, draft_flags = DRAFTS[kind](dict(target=target_path, small=small_draft_path, fp8=fp8_draft_path))
    target = load_model(target_path, registry=client, deployment=deployment)
    assert target.plan.decisions[FUSION].value is True
    assert target.model.layers[1].mlp.experts.num_fused_shared_experts == 1
    ids = prompt(B=1, T=6)
    before = snapshot(target, ids)
    assert before[2]["model.layers.1.mlp.experts.num_fused_shared_experts"] == 1   # the snapshot sees bakes

    draft = load_model(draft_path, registry=client, deployment=deployment, role="speculative",
                       **load_kwargs(**draft_flags))

    after = snapshot(target, ids)
    assert after[0] is before[0]                      # the same plan object
    assert after[1] == before[1]                      # its decisions, reasons and rules
    assert after[2] == before[2]                      # every baked attribute of every layer
    assert after[3].keys() == before[3].keys()
    assert all(torch.equal(after[3][k], before[3][k]) for k in before[3])
    assert torch.equal(after[4], before[4])           # its logits
    # the draft has its own plan, under the same deployment, with its own decision
    assert draft.plan.request.role == "speculative" and draft.plan.request.deployment_id == deployment
    assert draft.plan.plan_id != target.plan.plan_id
    assert draft.plan.decisions[FUSION].value is False
    assert target.plan.decisions[FUSION].value is True
    assert target.plan.quantization is None
    assert draft.plan.quantization == ("fp8" if draft_path == fp8_draft_path else None)
    # the registry's record of the target is unchanged too: one revision per decision
    stored = client.get_plan(target.plan.plan_id, include_history=True)
    assert {k: d.value for k, d in stored.decisions.items()} == {k: v[0] for k, v in before[1].items()}
    assert len(stored.history) == len(stored.decisions)

    # `loadplan plans diff TARGET DRAFT` shows the decision that differs
    a, b = target.plan.plan_id, draft.plan.plan_id
    assert main(["plans", "diff", a, b, "--db", url, "--json"]) == 0
    diff = json.loads(capsys.readouterr().out)
    row = {d["key"]: d for d in diff["decisions"]}[FUSION]
    assert row["a"]["value"] is True and row["b"]["value"] is False and row["b"]["reason"]
    assert main(["plans", "diff", a, b, "--db", url]) == 0
    text = capsys.readouterr().out
    line = next(l for l in text.splitlines() if l.startswith(FUSION))
    assert line.split()[1:3] == ["true", "false"]
    assert "speculative" in text and "target" in text


def test_speculative_tokens_of_the_deepseek_pair_equal_transformers(target_path, small_draft_path, registry):
    """MLA caches roll back too: a DeepSeek target with a DeepSeek draft gives transformers' greedy tokens."""
    _, client = registry
    target = load_model(target_path, registry=client, deployment="isolation-tokens")
    draft = load_model(small_draft_path, registry=client, deployment="isolation-tokens", role="speculative")
    ids = [3, 17, 42, 9, 100]
    with torch.no_grad():
        want = hf_reference(target_path, "DeepseekV3ForCausalLM").generate(
            torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    for k in (2, 5):
        tokens, stats = speculative_generate(target, draft, ids, 8, k)
        assert tokens == want[0, len(ids):].tolist()
        assert stats["proposed"] > 0
