"""Qwen3.5-MoE from save_pretrained checkpoints: its text model and the Hub's multimodal wrapper run text-only,
logits and greedy tokens against transformers, float32, fused (as planned) and unfused; the wrapper's experts
stacked as transformers holds them; its vision tower and MTP module skipped by name; of the fields transformers'
Qwen3.5-MoE does not read, those the layout has (decoder_sparse_step, mlp_only_layers) ignored as it does, the
others refused when they say otherwise. TP 2 with its separate projections:
tests/engine/parallel/test_tensor_parallel.py (EP: its MoE block is Qwen3-Next's, tests/engine/parallel)."""

from __future__ import annotations

import json

import pytest
import torch

from loadplan.engine.layers.attention import GQAttention
from loadplan.engine.layers.gated_delta_net import GatedDeltaNet
from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (QWEN3_5_MOE_TINY, check_refused_before_any_plan, hf_greedy, hf_logits_of_order_one,
                            load_local, logits_of, make_qwen3_5_moe_checkpoint, prompt, with_config, with_tensors)

TEXT, WRAPPER = "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"
TOL = 1e-4
# The text model's random checkpoint is ill-conditioned in float32: transformers' own logits move by 6.7e-4 when its
# input embeddings are perturbed by 1e-7 relative (float32 rounding), so another CPU's rounding (AMD EPYC against
# the Intel parts this was first run on) puts the engine 1.7e-4 from transformers. A wrong fusion decision moves the
# logits by far more (a shared expert counted twice or dropped: O(0.1)).
TEXT_TOL = 1e-3
N_NEW = 6


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    return make_qwen3_5_moe_checkpoint(tmp_path_factory.mktemp("qwen3_5_text"))


@pytest.fixture(scope="module")
def wrapper_ckpt(tmp_path_factory):
    return make_qwen3_5_moe_checkpoint(tmp_path_factory.mktemp("qwen3_5_vl"), wrapper=True)


@pytest.fixture(scope="module")
def ids():
    return prompt(T=9)


def generate_tokens(model, ids):
    from loadplan.engine.generate import generate

    return generate(model, ids[0], N_NEW)[0].tolist()


@pytest.mark.parametrize("which", [TEXT, WRAPPER])
def test_logits_and_greedy_tokens_match_transformers_fused_and_unfused(text_ckpt, wrapper_ckpt, ids, which):
    ckpt = text_ckpt if which == TEXT else wrapper_ckpt
    want = hf_logits_of_order_one(ckpt, which, ids)
    model = load_local(ckpt)
    assert model.plan.entry_class == which and model.plan.decisions[Keys.SHARED_EXPERTS_FUSION].value is True
    text = model if which == TEXT else model.language_model
    layers = text.model.layers
    assert [type(layer.mixer) for layer in layers] == [GatedDeltaNet] * 3 + [GQAttention]
    assert not layers[0].mixer.grouped and hasattr(layers[0].mixer, "in_proj_qkv")
    assert text.moe_layer_ids == (0, 1, 2, 3)
    tol = TEXT_TOL if which == TEXT else TOL
    assert (logits_of(model, ids) - want).abs().max().item() <= tol
    assert generate_tokens(model, ids) == hf_greedy(ckpt, which, ids[0].tolist(), N_NEW)
    unfused = load_local(ckpt, disable_shared_experts_fusion=True)
    assert unfused.plan.decisions[Keys.SHARED_EXPERTS_FUSION].value is False
    assert (logits_of(unfused, ids) - want).abs().max().item() <= tol


def test_the_wrappers_stacked_experts_and_skipped_towers(ids, tmp_path):
    """Experts stacked per layer as transformers holds them ([E, 2I, D], gate then up; [E, D, I]), an MTP module
    beside the vision tower: the same model. (Experts 16 wide, so that [E, 2I, D] and [E, D, 2I] differ.)"""
    per_expert = make_qwen3_5_moe_checkpoint(tmp_path / "per_expert", wrapper=True, moe_intermediate_size=16,
                                             shared_expert_intermediate_size=16)
    want = hf_logits_of_order_one(per_expert, WRAPPER, ids)
    E = QWEN3_5_MOE_TINY["num_experts"]

    def stack_and_add_mtp(tensors):
        for layer in range(QWEN3_5_MOE_TINY["num_hidden_layers"]):
            block = f"model.language_model.layers.{layer}.mlp.experts"
            one = lambda e, p: tensors.pop(f"{block}.{e}.{p}_proj.weight")   # noqa: E731
            gate_up = [torch.cat([one(e, "gate"), one(e, "up")]) for e in range(E)]
            tensors[f"{block}.gate_up_proj"] = torch.stack(gate_up)
            tensors[f"{block}.down_proj"] = torch.stack([one(e, "down") for e in range(E)])
        tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    stacked = with_tensors(per_expert, tmp_path / "stacked", stack_and_add_mtp)
    assert (logits_of(load_local(stacked), ids) - want).abs().max().item() <= TOL


@pytest.mark.parametrize("overrides", [{"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}])
def test_fields_its_model_does_not_read_leave_every_layer_moe(text_ckpt, tmp_path, ids, overrides):
    """Qwen3.5-MoE's config class inherits decoder_sparse_step and mlp_only_layers from Qwen3-Next's, its model (and
    SGLang's) reads neither: every layer is MoE in the plan and the model, with transformers' logits."""
    ckpt = with_config(text_ckpt, tmp_path / "ignored", **overrides)
    model = load_local(ckpt)
    assert model.moe_layer_ids == (0, 1, 2, 3)
    assert model.plan.decisions[Keys.SHARED_EXPERTS_FUSION].value is True
    assert (logits_of(model, ids) - hf_logits_of_order_one(ckpt, TEXT, ids)).abs().max().item() <= TEXT_TOL


@pytest.mark.parametrize("overrides, match", [
    ({"norm_topk_prob": False}, r"config\.norm_topk_prob: False not supported; Qwen3\.5-MoE runs True"),
    ({"attn_output_gate": False}, r"config\.attn_output_gate: False not supported"),
    ({"linear_key_head_dim": None}, r"config\.linear_key_head_dim: missing"),
])
def test_a_text_config_it_cannot_run_is_refused_by_field_before_any_plan(text_ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(text_ckpt, tmp_path / "bad", **overrides), ConfigError, match)


def test_the_wrapper_names_the_field_inside_text_config(wrapper_ckpt, tmp_path):
    cfg = json.loads((wrapper_ckpt / "config.json").read_text())
    bad = with_config(wrapper_ckpt, tmp_path / "bad", text_config=dict(cfg["text_config"], norm_topk_prob=False))
    check_refused_before_any_plan(bad, ConfigError, r"config\.text_config\.norm_topk_prob: False not supported")
