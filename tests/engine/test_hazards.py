"""Every hazard the registry refuses (service/rules/hazards.py) is a layout that changes the logits.

Shown on loadplan's engine, built through the loader from a plan: the layout SGLang's code takes where the sglang
profile refuses (its forward path, reductions and fused slot, written as the plan's decisions; its weight loading,
as the checkpoint its fused loader reads), against transformers' logits of the same checkpoint. The plan the
registry answers instead (the hazard's safe alternative) gives transformers' logits; the hazard's layout does not.

A fake registry (`EditedRegistry`) resolves each runner's plan with the registry's own rules and then applies the
decisions SGLang's code path takes: the engine builds whatever a plan says, so the layout is the engine's own, not
a tensor changed after the build.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loadplan.engine.parallel.launch import launch
from loadplan.plan import Keys, Runtime
from loadplan.service.rules.hazards import HAZARDS

from engine_helpers import DEEPSEEK_TINY, LocalRegistry, hf_logits_of_order_one, load_local, make_deepseek_checkpoint, \
    prompt

ARCH = "DeepseekV3ForCausalLM"
EP = 2
TOL = 1e-4
TESTED = {"sglang.double_reduction", "sglang.fused_global_slot_on_dispatch", "sglang.enforced_384_without_quark"}


class EditedRegistry(LocalRegistry):
    """The registry's plan for each runner, with `edits` applied: {decision key: value, or fn(ep_rank) -> value}."""

    def __init__(self, edits: dict):
        super().__init__()
        self.edits = edits

    def resolve_load_plan(self, request):
        plan = super().resolve_load_plan(request)
        decisions = dict(plan.decisions)
        for key, value in self.edits.items():
            value = value(request.parallel.ep_rank) if callable(value) else value
            decisions[key] = replace(decisions[key], value=value, reason="the layout SGLang's code takes",
                                     rule="test.sglang_layout")
        return replace(plan, decisions=decisions)


# The layouts on 2 EP ranks, each on nixl (a2a: dispatch, experts, a combine that returns complete rows):
# - safe: the registry's plan (nixl cannot hold a fused slot on every rank: the shared expert is unfused);
# - double_reduction: SGLang's normal branch after its experts layer's combine: `reduce_moe_output`'s all-reduce;
# - global_slot: --enforce-shared-experts-fusion on nixl, not a per-rank-slot backend: SGLang's loader puts the one
#   fused slot at physical expert n_routed (fused_moe_triton/layer.py), on one rank's experts, so only the tokens of
#   that rank see it: the slot's weight is the routed weight sum on that rank (scale 1) and nothing on the others.
EP_CASES = {
    "safe": {},
    "double_reduction": {Keys.POST_EXPERTS_ALL_REDUCE: True},
    "global_slot": {Keys.SHARED_EXPERTS_FUSION: True, Keys.NUM_FUSED_SHARED_EXPERTS: 1,
                    Keys.FUSED_SHARED_EXPERT_SCALE: lambda ep_rank: 1.0 if ep_rank == EP - 1 else 0.0},
}


def _ep_ranks(rank, world_size, path, ids):
    from loadplan.engine.worker import WorkerSpec, init_rank, load_runner

    spec = WorkerSpec(model=path, prompt_ids=(), max_new_tokens=0, ep_size=world_size,
                      runtime=Runtime(a2a_backend="nixl"))
    grid = init_rank(spec)
    out = {}
    for name, edits in EP_CASES.items():
        model = load_runner(spec, grid, registry=EditedRegistry(edits))
        d = model.plan.decisions
        with torch.no_grad():
            out[name] = dict(logits=model(ids), path=d[Keys.FORWARD_PATH].value,
                             all_reduce=d[Keys.POST_EXPERTS_ALL_REDUCE].value,
                             fused=d[Keys.SHARED_EXPERTS_FUSION].value)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_deepseek_checkpoint(tmp_path_factory.mktemp("hazards"), **DEEPSEEK_TINY)


@pytest.fixture(scope="module")
def ids():
    return prompt(B=2, T=6, vocab=DEEPSEEK_TINY["vocab_size"])


@pytest.fixture(scope="module")
def on_two_ranks(checkpoint, ids):
    return launch(EP, _ep_ranks, str(checkpoint), ids, timeout_s=180)


def differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() > 1e-2


def test_every_hazard_has_its_logits_test_here():
    assert set(HAZARDS) == TESTED


def test_the_registry_plan_on_nixl_gives_transformers_logits(checkpoint, ids, on_two_ranks):
    want = hf_logits_of_order_one(checkpoint, ARCH, ids)
    for r in range(EP):
        case = on_two_ranks[r]["safe"]
        assert (case["path"], case["all_reduce"], case["fused"]) == ("a2a", False, False)
        torch.testing.assert_close(case["logits"], want, atol=TOL, rtol=TOL)


def test_double_reduction_built_from_its_plan_changes_the_logits(checkpoint, ids, on_two_ranks):
    """The all-reduce after a combine that already returned each token's whole output adds the other rank's
    tokens' outputs into this rank's."""
    want = hf_logits_of_order_one(checkpoint, ARCH, ids)
    for r in range(EP):
        case = on_two_ranks[r]["double_reduction"]
        assert (case["path"], case["all_reduce"]) == ("a2a", True)
        assert differs(case["logits"], want)


def test_a_global_fused_slot_on_a_dispatch_path_built_from_its_plan_changes_the_logits(checkpoint, ids, on_two_ranks):
    """The shared expert fused as one global slot: the tokens of the ranks that do not hold it lose it."""
    want = hf_logits_of_order_one(checkpoint, ARCH, ids)
    assert [on_two_ranks[r]["global_slot"]["fused"] for r in range(EP)] == [True, True]
    assert differs(on_two_ranks[0]["global_slot"]["logits"], want)
    # the rank holding the slot runs it as the per-rank slot of a DeepEP-class backend would: right
    torch.testing.assert_close(on_two_ranks[EP - 1]["global_slot"]["logits"], want, atol=TOL, rtol=TOL)


# --- the 384-expert layout -----------------------------------------------------------------------------------------

KIMI_TINY = dict(DEEPSEEK_TINY, n_routed_experts=384)
FUSED = {Keys.SHARED_EXPERTS_FUSION: True, Keys.NUM_FUSED_SHARED_EXPERTS: 1, Keys.FUSED_SHARED_EXPERT_SCALE: 1.0}


def as_sglangs_fused_loader_reads_it(src: Path, dst: Path, slot: int) -> Path:
    """The checkpoint SGLang's fused 384-expert path loads: it builds no shared-expert module, so the loose
    `mlp.shared_experts.*` tensors are never read, and it expects the slot pre-fused as `mlp.experts.{slot}.*`,
    which a loose checkpoint does not hold: SGLang leaves that slot as allocated (torch.empty; zeros here, to be
    deterministic)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
            continue
        tensors = load_file(f)
        kept = {}
        for name, t in tensors.items():
            if ".mlp.shared_experts." in name:
                mlp, proj = name.split(".shared_experts.")
                kept[f"{mlp}.experts.{slot}.{proj}"] = torch.zeros_like(t)
            else:
                kept[name] = t
        save_file(kept, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    return make_deepseek_checkpoint(tmp_path_factory.mktemp("kimi384"), **KIMI_TINY)


def test_the_registry_plan_for_384_experts_without_quark_gives_transformers_logits(kimi, ids):
    model = load_local(kimi, enforce_shared_experts_fusion=True)
    assert model.plan.decisions[Keys.SHARED_EXPERTS_FUSION].value is False   # 384 experts are pre-fused only in Quark
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf_logits_of_order_one(kimi, ARCH, ids), atol=TOL, rtol=TOL)


def test_the_fused_384_layout_loaded_as_sglang_loads_it_changes_the_logits(kimi, ids, tmp_path):
    from loadplan.engine.loader import load_model
    from loadplan.engine.weights import MissingTensor

    seen = as_sglangs_fused_loader_reads_it(kimi, tmp_path / "as-loaded", slot=384)
    model = load_model(seen, registry=EditedRegistry(FUSED))
    assert model.plan.decisions[Keys.NUM_FUSED_SHARED_EXPERTS].value == 1
    with torch.no_grad():
        assert differs(model(ids), hf_logits_of_order_one(kimi, ARCH, ids))
    # loadplan's own loader, given the loose checkpoint without its shared expert (what SGLang's fused path reads
    # of it), refuses at the weight boundary instead, naming the slot's tensor
    hidden = tmp_path / "no-shared"
    hidden.mkdir()
    for f in kimi.iterdir():
        if f.suffix == ".safetensors":
            save_file({n: t for n, t in load_file(f).items() if ".mlp.shared_experts." not in n}, hidden / f.name)
        else:
            (hidden / f.name).write_bytes(f.read_bytes())
    with pytest.raises(MissingTensor, match=r"experts\.384"):
        load_model(hidden, registry=EditedRegistry(FUSED))
