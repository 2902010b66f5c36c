"""Qwen3-VL-MoE run text-only: logits and greedy tokens against transformers' whole model on text (its MRoPE
reduces to the plain rotary there), from its own checkpoint layout (`model.language_model.*`, stacked experts either
way round); what it refuses by field and by tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from loadplan.engine.checkpoint import Checkpoint
from loadplan.engine.generate import generate
from loadplan.engine.models.config import ConfigError
from loadplan.engine.stacked_experts import StackedExperts
from loadplan.engine.weights import ShapeMismatch
from loadplan.plan import Keys

from engine_helpers import check_refused_before_any_plan, load_local, logits_of, make_qwen3_vl_moe_checkpoint, prompt

ARCH = "Qwen3VLMoeForConditionalGeneration"
TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_vl_moe_checkpoint(tmp_path_factory.mktemp("qwen3_vl_moe"))


@pytest.fixture(scope="module")
def ids():
    return prompt(B=1, T=9)


@pytest.fixture(scope="module")
def hf(ckpt):
    import transformers

    return transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def reference(hf, ids):
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    assert 0.5 < want.abs().max() < 50
    return want


def test_text_logits_and_greedy_tokens_match_transformers(ckpt, ids, hf, reference):
    model = load_local(ckpt)
    assert model.plan.entry_class == ARCH
    assert model.plan.decisions[Keys.SHARED_EXPERTS_FUSION].rule == "qwen3_moe.no_shared_experts"
    assert model.language_model.config.norm_topk_prob is True            # its router always renormalises
    assert (logits_of(model, ids) - reference).abs().max().item() <= TOL
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 9:].tolist()
    assert generate(model, ids[0], 6)[0].tolist() == want


def test_experts_stacked_transposed_as_on_the_hub_read_alike(ckpt, ids, reference, tmp_path):
    """The Hub's files hold gate_up_proj [E, D, 2I] and down_proj [E, I, D] (transformers transposes them on load)."""
    tensors = load_file(ckpt / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    hub = tmp_path / "hub"
    hub.mkdir()
    save_file(tensors, hub / "model.safetensors")
    (hub / "config.json").write_text((ckpt / "config.json").read_text())
    assert tuple(Checkpoint(hub).shape("model.language_model.layers.0.mlp.experts.gate_up_proj")) == (8, 64, 32)
    assert (logits_of(load_local(hub), ids) - reference).abs().max().item() <= TOL


def test_a_stacked_matrix_of_neither_or_both_orientations_is_refused(ckpt, tmp_path):
    """A shape that fits neither is named; with D == I a square down_proj could be either way round: refused, not
    guessed."""
    with pytest.raises(ShapeMismatch, match=r"experts\.down_proj' has shape \[8, 64, 16\]: expected \[E, 40, 64\]"):
        StackedExperts(Checkpoint(ckpt), 8, gate_up="concatenated", hidden_size=64, expert_width=40)
    tensors = load_file(ckpt / "model.safetensors")
    for name in [n for n in tensors if n.endswith("experts.down_proj")]:
        tensors[name] = torch.zeros(8, 64, 64)
    square = tmp_path / "square"
    square.mkdir()
    save_file(tensors, square / "model.safetensors")
    (square / "config.json").write_text((ckpt / "config.json").read_text())
    with pytest.raises(ShapeMismatch, match=r"down_proj' has shape \[8, 64, 64\], which fits both orientations"):
        StackedExperts(Checkpoint(square), 8, gate_up="concatenated", hidden_size=64, expert_width=64)


def test_a_text_config_that_says_norm_topk_prob_false_is_refused_before_any_plan(ckpt, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["norm_topk_prob"] = False
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    (bad / "config.json").write_text(json.dumps(cfg))
    check_refused_before_any_plan(bad, ConfigError, r"config\.text_config\.norm_topk_prob: false not supported")
