"""Every hazard the registry refuses (service/rules/hazards.py) prevents a layout that changes the logits.

Shown on loadplan's engine: a tiny DeepSeek-V3 (256 routed experts and one shared, fused by loadplan's own rules),
with the prevented layout made by hand in one process: what SGLang's code path would run, on one rank's view.
"""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.moe import RoutedExperts
from loadplan.service.rules.hazards import HAZARDS

from engine_helpers import DEEPSEEK_TINY, load_local, logits_of, make_deepseek_checkpoint, prompt

pytest.importorskip("transformers")

TESTED = {"sglang.double_reduction", "sglang.fused_global_slot_on_dispatch", "sglang.enforced_384_without_quark",
          "sglang.nextn_without_mtp_layer"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_local(make_deepseek_checkpoint(tmp_path_factory.mktemp("hazards"), **DEEPSEEK_TINY))


@pytest.fixture(scope="module")
def ids():
    return prompt(B=2, T=6, vocab=DEEPSEEK_TINY["vocab_size"])


@pytest.fixture(scope="module")
def reference(model, ids):
    global _SAVED
    _SAVED = {n: p.detach().clone() for n, p in model.named_parameters()}
    return logits_of(model, ids)


_SAVED: dict = {}


def model_restore(model) -> None:
    """Put back the loaded weights a test changed."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(_SAVED[n])


def experts_of(model) -> list[RoutedExperts]:
    found = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert found and all(e.num_fused_shared_experts == 1 for e in found)   # the fused layout under test
    return found


def changed(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not torch.allclose(a, b, atol=1e-3, rtol=1e-3)


def test_every_hazard_has_its_logits_test_here():
    assert set(HAZARDS) == TESTED


def test_double_reduction_changes_the_logits(model, ids, reference, monkeypatch):
    """The normal branch's all-reduce after a combine that already returned each token's whole output: over
    ep_size=2 ranks every rank adds the same complete output twice."""
    for ex in experts_of(model):
        monkeypatch.setattr(ex, "post_experts_all_reduce", True)
        monkeypatch.setattr(ex, "reduce", lambda y: y + y)    # the all-reduce of 2 ranks holding the same whole y
    assert changed(logits_of(model, ids), reference)


@pytest.mark.parametrize("scale", [0.0, 2.0], ids=["dropped", "counted_per_rank"])
def test_a_global_fused_slot_on_a_dispatch_path_changes_the_logits(model, ids, reference, scale):
    """A global fused slot dispatched as a routed expert: its tokens' shared expert is dropped where the slot's rank
    is not reached (x0), or counted once per rank holding a copy (2 ranks: x2). The slot's output is linear in its
    down projection, so scaling that projection scales the slot's contribution."""
    with torch.no_grad():
        for ex in experts_of(model):
            ex.down_proj[-1].mul_(scale)
    try:
        assert changed(logits_of(model, ids), reference)
    finally:
        model_restore(model)


def test_a_mis_loaded_fused_slot_changes_the_logits(model, ids, reference):
    """The 384-expert pre-fused layout read from a checkpoint that stores its shared expert loose: the fused slot
    holds other weights than the shared expert's (here: routed expert 0's)."""
    saved = []
    with torch.no_grad():
        for ex in experts_of(model):
            slot = ex.gate_up_proj.shape[0] - 1
            saved.append((ex, ex.gate_up_proj[slot].clone(), ex.down_proj[slot].clone()))
            ex.gate_up_proj[slot].copy_(ex.gate_up_proj[0])
            ex.down_proj[slot].copy_(ex.down_proj[0])
    try:
        assert changed(logits_of(model, ids), reference)
    finally:
        with torch.no_grad():
            for ex, gu, dn in saved:
                ex.gate_up_proj[-1].copy_(gu)
                ex.down_proj[-1].copy_(dn)
    assert not changed(logits_of(model, ids), reference)


def test_a_layer_whose_weights_were_never_loaded_changes_the_logits(model, ids, reference):
    """A NextN layer built from a checkpoint without it (num_nextn_predict_layers 0) runs on weights that were
    never loaded: shown on the last decoder layer, the layer a NextN draft adds."""
    layer = model.model.layers[-1]
    saved = {n: p.detach().clone() for n, p in layer.named_parameters()}
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.02)
    try:
        assert changed(logits_of(model, ids), reference)
    finally:
        with torch.no_grad():
            for n, p in layer.named_parameters():
                p.copy_(saved[n])
