"""MiniMax-M2 from save_pretrained checkpoints (the Hub's spelling, `block_sparse_moe.*`): logits and greedy tokens
against transformers, float32; what sets it apart shown to matter (the routing correction bias, the partial rotary,
the whole-projection q/k norms); a block-FP8 copy as MiniMax ships it; the spelling table; the config fields
transformers leaves unread refused by field when they would change the arithmetic. Every backend on EP 2 and TP 2:
tests/engine/parallel."""

from __future__ import annotations

import json

import pytest
import torch

from loadplan.engine.models.config import ConfigError
from loadplan.engine.models.minimax_m2 import MINIMAX_M2_NAMES
from loadplan.engine.weights import UnexpectedTensor
from loadplan.plan import Keys

from engine_helpers import (check_refused_before_any_plan, hf_greedy, hf_logits_of_order_one, load_local, logits_of,
                            make_fp8_copies, make_minimax_m2_checkpoint, prompt, with_config, with_tensors)

ARCH = "MiniMaxM2ForCausalLM"
TOL = 1e-4
N_NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_minimax_m2_checkpoint(tmp_path_factory.mktemp("minimax_m2"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=9)


@pytest.fixture(scope="module")
def reference(ckpt, ids):
    return hf_logits_of_order_one(ckpt, ARCH, ids)


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids, reference):
    model = load_local(ckpt)
    fusion = model.plan.decisions[Keys.SHARED_EXPERTS_FUSION]
    assert (fusion.value, fusion.rule) == (False, "minimax_m2.no_shared_experts")
    assert model.moe_layer_ids == (0, 1, 2)
    attn = model.model.layers[0].self_attn
    assert attn.rotary_dim == 8 and attn.head_dim == 16 and attn.q_norm is None
    assert tuple(attn.q_proj_norm.weight.shape) == (64,) and tuple(attn.k_proj_norm.weight.shape) == (32,)
    gate = model.model.layers[0].mlp.gate
    assert (gate.n_group, gate.routed_scaling_factor, gate.norm_topk_prob) == (1, 1.0, True)
    assert gate.e_score_correction_bias.abs().max() > 0                    # read from the checkpoint
    assert (logits_of(model, ids) - reference).abs().max().item() <= TOL
    assert generate_tokens(model, ids) == hf_greedy(ckpt, ARCH, ids[0].tolist(), N_NEW)


def generate_tokens(model, ids):
    from loadplan.engine.generate import generate

    return generate(model, ids[0], N_NEW)[0].tolist()


def test_the_routing_correction_bias_chooses_the_experts(ckpt, ids, reference, tmp_path):
    """A large bias on expert 0 makes every token choose it (the choice), while the weights stay the scores'."""
    def favour(tensors):
        for name in tensors:
            if name.endswith("e_score_correction_bias"):
                tensors[name] = torch.zeros_like(tensors[name])
                tensors[name][0] = 5.0
    biased = with_tensors(ckpt, tmp_path / "biased", favour)
    want = hf_logits_of_order_one(biased, ARCH, ids)
    assert (want - reference).abs().max().item() > 1e-2
    assert (logits_of(load_local(biased), ids) - want).abs().max().item() <= TOL


def _rope(factor):
    return {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": factor}


@pytest.mark.parametrize("overrides", [
    {"rotary_dim": 16, "rope_parameters": _rope(1.0)},                 # every feature rotated
    {"rotary_dim": 4, "rope_parameters": _rope(0.25)},
    {"rotary_dim": 4, "rope_parameters": None, "rope_theta": 5e6},     # as the Hub's files: rotary_dim alone
    {"rope_parameters": None, "rope_theta": 10000.0},                  # another theta
])
def test_the_rotated_share_and_theta_match_transformers_and_bite(ckpt, ids, reference, tmp_path, overrides):
    changed = with_config(ckpt, tmp_path / "changed", **overrides)
    want = hf_logits_of_order_one(changed, ARCH, ids)
    assert (want - reference).abs().max().item() > 1e-2
    assert (logits_of(load_local(changed), ids) - want).abs().max().item() <= TOL


def test_a_block_fp8_copy_as_minimax_ships_matches_transformers_on_its_weights(ckpt, ids, tmp_path):
    """The experts' w1/w2/w3 and the attention projections in FP8 blocks (MiniMax-M2's `fp8` [128, 128],
    here [16, 16]); the router, its bias, norms and embeddings plain."""
    fp8, dequantized, n = make_fp8_copies(ckpt, tmp_path, [16, 16])
    assert n == 3 * (4 + 8 * 3)
    want = hf_logits_of_order_one(dequantized, ARCH, ids)
    model = load_local(fp8)
    assert model.plan.quantization == "fp8"
    assert (logits_of(model, ids) - want).abs().max().item() <= TOL


@pytest.mark.parametrize("checkpoint, engine", [
    ("model.layers.3.block_sparse_moe.e_score_correction_bias", "model.layers.3.mlp.gate.e_score_correction_bias"),
    ("model.layers.3.block_sparse_moe.gate.weight", "model.layers.3.mlp.gate.weight"),
    ("model.layers.0.block_sparse_moe.experts.7.w2.weight", "model.layers.0.mlp.experts.7.down_proj.weight"),
    ("model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.q_proj_norm.weight"),
])
def test_the_spelling_table_reads_both_ways(checkpoint, engine):
    assert MINIMAX_M2_NAMES.to_engine(checkpoint) == engine
    assert MINIMAX_M2_NAMES.to_checkpoint(engine) == checkpoint


@pytest.mark.parametrize("overrides, match", [
    ({"scoring_func": "softmax"}, r"config\.scoring_func: 'softmax' not supported; MiniMax-M2 runs 'sigmoid'"),
    ({"use_routing_bias": False}, r"config\.use_routing_bias: False not supported"),
    ({"use_qk_norm": False}, r"config\.use_qk_norm: False not supported"),
    ({"qk_norm_type": "per_head"}, r"config\.qk_norm_type: 'per_head' not supported"),
    ({"shared_intermediate_size": 64}, r"config\.shared_intermediate_size: 64 not supported"),
    ({"attn_type_list": [1, 0, 1]}, r"config\.attn_type_list: only full attention \(1\)"),
    ({"rotary_dim": 5, "rope_parameters": None}, r"config\.rotary_dim: 5 must be even"),
    ({"rotary_dim": 16}, r"config\.rotary_dim: 16 disagrees with partial_rotary_factor 0\.5 of head_dim 16"),
    ({"num_key_value_heads": None}, r"config\.num_key_value_heads: missing"),
    ({"num_experts_per_tok": 9}, r"config\.num_experts_per_tok: 9 exceeds the number of routed experts \(8\)"),
])
def test_a_config_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)


def test_the_fields_it_reads_as_shipped_are_accepted(ckpt, ids, reference, tmp_path):
    """The values MiniMax-M2's config.json gives those fields: the same model."""
    shipped = with_config(ckpt, tmp_path / "shipped", scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True,
                          qk_norm_type="per_layer", shared_intermediate_size=0, attn_type_list=[1, 1, 1])
    assert (logits_of(load_local(shipped), ids) - reference).abs().max().item() <= TOL


def test_its_mtp_modules_after_the_last_layer_are_skipped_and_another_layer_is_refused(ckpt, ids, reference, tmp_path):
    """MiniMax-M2 stores num_mtp_modules MTP modules as model.layers.{L + i}.*: skipped by name. Without that
    field the same tensors are a layer the model does not have: refused, naming the tensor."""
    def extra_layer(tensors):
        for name in [n for n in tensors if n.startswith("model.layers.2.")]:
            tensors[name.replace("model.layers.2.", "model.layers.3.", 1)] = tensors[name].clone()
    with_mtp = with_tensors(ckpt, tmp_path / "with_mtp", extra_layer)
    cfg = json.loads((with_mtp / "config.json").read_text())
    (with_mtp / "config.json").write_text(json.dumps(dict(cfg, num_mtp_modules=1, use_mtp=True)))
    assert (logits_of(load_local(with_mtp), ids) - reference).abs().max().item() <= TOL
    (with_mtp / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnexpectedTensor, match=r"model\.layers\.3\..*layer 3 is beyond the model's 3 layers"):
        load_local(with_mtp)
