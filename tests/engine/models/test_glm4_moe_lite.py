"""GLM-4-MoE-Lite (GLM-4.7-Flash) from save_pretrained checkpoints: logits and greedy tokens against transformers,
fused and unfused, float32; its own layer list and defaults; refusals by field. Every backend on EP 2, fused and
unfused: tests/engine/parallel; its layout and gate in the registry: tests/service/rules."""

from __future__ import annotations

import json

import pytest

from loadplan.engine.generate import generate
from loadplan.engine.models.config import ConfigError
from loadplan.engine.models.deepseek_v3 import DeepseekV3MoE
from loadplan.plan import Keys

from engine_helpers import (check_refused_before_any_plan, hf_greedy, hf_logits_of_order_one, load_local, logits_of,
                            make_glm4_lite_checkpoint, prompt, with_config)

ARCH = "Glm4MoeLiteForCausalLM"
TOL = 1e-4
N_NEW = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_glm4_lite_checkpoint(tmp_path_factory.mktemp("glm4_lite"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=7)


@pytest.fixture(scope="module")
def reference(ckpt, ids):
    return hf_logits_of_order_one(ckpt, ARCH, ids)


@pytest.mark.parametrize("disable", [False, True])
def test_logits_and_greedy_tokens_match_transformers_fused_and_unfused(ckpt, ids, reference, disable):
    model = load_local(ckpt, disable_shared_experts_fusion=disable)
    fusion = model.plan.decisions[Keys.SHARED_EXPERTS_FUSION]
    assert (fusion.value, fusion.rule) == ((False, "intent.disable_shared_experts_fusion") if disable else
                                           (True, "glm4_moe_lite.fused"))
    assert model.moe_layer_ids == (1, 2) and not isinstance(model.model.layers[0].mlp, DeepseekV3MoE)
    gate = model.model.layers[1].mlp.gate
    assert gate.routed_scaling_factor == 1.8 and gate.n_group == 1
    assert (logits_of(model, ids) - reference).abs().max().item() <= TOL
    assert generate(model, ids[0], N_NEW)[0].tolist() == hf_greedy(ckpt, ARCH, ids[0].tolist(), N_NEW)


def test_its_layer_list_decides_the_moe_layers(tmp_path, ids):
    path = make_glm4_lite_checkpoint(tmp_path / "dense_two", mlp_layer_types=["dense", "dense", "sparse"])
    want = hf_logits_of_order_one(path, ARCH, ids)
    model = load_local(path)
    assert model.moe_layer_ids == (2,)
    assert (logits_of(model, ids) - want).abs().max().item() <= TOL


@pytest.mark.parametrize("deepseeks", [dict(first_k_dense_replace=1, moe_layer_freq=1),
                                       dict(first_k_dense_replace=2, moe_layer_freq=2)])
def test_deepseeks_layer_fields_are_not_read_as_transformers_reads_neither(ckpt, ids, reference, tmp_path, deepseeks):
    """(SGLang reads first_k_dense_replace: the sglang profile refuses a config it would build otherwise.)"""
    model = load_local(with_config(ckpt, tmp_path / "deepseeks", **deepseeks))
    assert model.moe_layer_ids == (1, 2)
    assert (logits_of(model, ids) - reference).abs().max().item() <= TOL


def test_a_config_without_the_routing_fields_reads_its_own_defaults(ckpt, ids, reference, tmp_path):
    """transformers' Glm4MoeLiteConfig defaults (1.8 scaling, one shared expert, eps 1e-5), not DeepSeek-V3's."""
    cfg = json.loads((ckpt / "config.json").read_text())
    for name in ("routed_scaling_factor", "n_shared_experts", "rms_norm_eps", "mlp_layer_types", "n_group",
                 "topk_group", "norm_topk_prob"):
        cfg.pop(name)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    (bare / "config.json").write_text(json.dumps(cfg))
    assert (logits_of(load_local(bare), ids) - reference).abs().max().item() <= TOL


@pytest.mark.parametrize("overrides, match", [
    ({"mlp_layer_types": ["dense", "sparse"]}, r"config\.mlp_layer_types: expected 3 entries of dense or sparse"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, r"config\.mlp_layer_types"),
    ({"scoring_func": "softmax"}, r"config\.scoring_func: 'softmax' not supported"),
])
def test_a_config_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
