"""ERNIE-4.5 MoE (`Ernie4_5_MoeForCausalLM`: Llama's attention with pairwise rope over DeepSeek-V3's MoE block with
a softmax router) from save_pretrained checkpoints: logits and greedy tokens against transformers, float32, with
its MoE layers spread by start / end / interval, tied embeddings, and the checkpoint's MTP tensors skipped; the
registry plans it in its own family and never fuses its shared experts; what it cannot run is refused by field or
by tensor. EP 2 with every backend: tests/engine/parallel/test_expert_parallel.py; TP 2: test_tensor_parallel.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from loadplan.engine.models.config import ConfigError
from loadplan.engine.weights import ShapeMismatch
from loadplan.plan import Keys

from engine_helpers import (check_matches_transformers, check_refused_before_any_plan, hf_logits_of_order_one,
                            load_local, logits_of, make_ernie4_5_moe_checkpoint, prompt, with_config)

ARCH = "Ernie4_5_MoeForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_ernie4_5_moe_checkpoint(tmp_path_factory.mktemp("ernie"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=11)


def test_logits_and_greedy_tokens_match_transformers_and_its_shared_experts_are_never_fused(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "ernie4_5_moe" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "ernie4_5_moe.structural.no_fused_layout"
    assert model.moe_layer_ids == (1, 2) and model.model.layers[0].self_attn.rope_interleave
    mlp = model.model.layers[1].mlp
    assert mlp.shared_experts.gate_proj.out_features == 32 and mlp.gate.scoring == "softmax"
    assert mlp.gate.e_score_correction_bias.abs().min() > 0          # the checkpoint's [1, E] bias, read as [E]


def test_the_routing_bias_only_chooses_the_experts(ckpt, ids, tmp_path):
    """Moved by the bias, the choice of experts changes the logits; the weights are the unbiased softmax scores
    (a router weighting by the biased ones fails the first test)."""
    tensors = load_file(ckpt / "model.safetensors")
    for name in tensors:
        if name.endswith("moe_statics.e_score_correction_bias"):
            tensors[name] = torch.zeros_like(tensors[name])
    zero = tmp_path / "zero_bias"
    zero.mkdir()
    save_file(tensors, zero / "model.safetensors", metadata={"format": "pt"})
    (zero / "config.json").write_text((ckpt / "config.json").read_text())
    assert (logits_of(load_local(zero), ids) - logits_of(load_local(ckpt), ids)).abs().max().item() > 1e-2
    assert (logits_of(load_local(zero), ids) - hf_logits_of_order_one(zero, ARCH, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("config, moe_layers", [
    (dict(num_hidden_layers=4, moe_layer_start_index=0, moe_layer_end_index=2, moe_layer_interval=1), (0, 1, 2)),
    (dict(num_hidden_layers=4, moe_layer_interval=2, tie_word_embeddings=True), (1, 3)),
    (dict(moe_num_shared_experts=0), (1, 2)),                                  # routed experts alone
])
def test_its_variants_match_transformers(tmp_path, ids, config, moe_layers):
    model = check_matches_transformers(make_ernie4_5_moe_checkpoint(tmp_path / "v", **config), ARCH, ids)
    assert model.moe_layer_ids == moe_layers
    assert (model.lm_head is None) == config.get("tie_word_embeddings", False)
    shared = model.model.layers[moe_layers[0]].mlp.shared_experts
    assert (shared is None) == (config.get("moe_num_shared_experts") == 0)
    if shared is None:
        assert model.plan.decisions[Keys.SHARED_EXPERTS_FUSION].rule == "ernie4_5_moe.no_shared_experts"


def test_the_checkpoints_mtp_tensors_are_skipped(ckpt, ids, tmp_path):
    """The published checkpoints keep a Multi-Token-Prediction block beside the model (`model.mtp_*`), which
    transformers does not load either."""
    tensors = load_file(ckpt / "model.safetensors")
    tensors.update({"model.mtp_block.0.mlp.gate.weight": torch.zeros(8, 32), "model.mtp_emb_norm.0.weight":
                    torch.ones(32), "model.mtp_linear_proj.0.weight": torch.zeros(32, 64)})
    with_mtp = tmp_path / "mtp"
    with_mtp.mkdir()
    save_file(tensors, with_mtp / "model.safetensors", metadata={"format": "pt"})
    (with_mtp / "config.json").write_text((ckpt / "config.json").read_text())
    assert torch.equal(logits_of(load_local(with_mtp), ids), logits_of(load_local(ckpt), ids))


@pytest.mark.parametrize("override, match", [
    ({"use_bias": True}, r"config\.use_bias: true not supported"),
    ({"moe_layer_end_index": None}, r"config\.moe_layer_end_index: null"),
    ({"moe_gate_act": "sigmoid"}, r"config\.moe_gate_act: 'sigmoid' not supported; supported: softmax"),
    ({"moe_k": 9}, r"config\.moe_k: 9 exceeds the number of routed experts \(8\)"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}},
     r"config\.partial_rotary_factor: 0\.5 not supported"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, override, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **override), ConfigError, match)


def test_a_routing_bias_of_several_groups_is_refused_naming_the_tensor(ckpt, tmp_path):
    """ERNIE-4.5-VL keeps one bias row for its text experts and one for its vision experts: not this model's."""
    tensors = load_file(ckpt / "model.safetensors")
    name = "model.layers.1.mlp.moe_statics.e_score_correction_bias"
    tensors[name] = tensors[name].repeat(2, 1)
    two = tmp_path / "two_groups"
    two.mkdir()
    save_file(tensors, two / "model.safetensors", metadata={"format": "pt"})
    (two / "config.json").write_text(json.dumps(json.loads((ckpt / "config.json").read_text())))
    with pytest.raises(ShapeMismatch, match=rf"{name}: shape \[2, 8\]; one group of experts \(\[1, E\]\) expected"):
        load_local(two)
