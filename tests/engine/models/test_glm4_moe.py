"""GLM-4-MoE from save_pretrained checkpoints: logits against transformers, float32, fused and unfused."""

from __future__ import annotations

import dataclasses
import json

import pytest

from loadplan.engine.generate import generate
from loadplan.engine.layers.mlp import GatedMLP
from loadplan.engine.models.glm4_moe import ConfigError, Glm4MoeConfig

from engine_helpers import GLM4_TINY as TINY
from engine_helpers import (hf_greedy, hf_logits, hf_logits_of_order_one, load_local, logits_of, make_glm4_checkpoint,
                            prompt)

transformers = pytest.importorskip("transformers")

ARCH = "Glm4MoeForCausalLM"
ATOL = 1e-3


def make_glm4(path, *, seed=0, drop_partial_rotary=False, **overrides):
    make_glm4_checkpoint(path, seed=seed, **dict(TINY, **overrides))
    if drop_partial_rotary:   # an older config.json that does not say: both sides must assume 0.5
        f = path / "config.json"
        cfg = json.loads(f.read_text())
        cfg["rope_parameters"].pop("partial_rotary_factor")
        cfg.pop("partial_rotary_factor", None)
        f.write_text(json.dumps(cfg, indent=2))
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_glm4(tmp_path_factory.mktemp("glm4"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=9)


@pytest.fixture(scope="module")
def reference(ckpt, ids):
    return hf_logits_of_order_one(ckpt, ARCH, ids)


def test_fused_and_unfused_match_transformers_and_each_other(ckpt, ids, reference):
    fused, unfused = load_local(ckpt), load_local(ckpt, disable_shared_experts_fusion=True)
    d = fused.plan.decisions
    assert d["moe.shared_experts_fusion"].value is True and d["moe.num_fused_shared_experts"].value == 1
    assert unfused.plan.decisions["moe.shared_experts_fusion"].value is False
    mf, mu = fused.model.layers[1].mlp, unfused.model.layers[1].mlp
    assert mf.experts.gate_up_proj.shape[0] == 17 and mf.shared_experts is None
    assert mu.experts.gate_up_proj.shape[0] == 16 and mu.shared_experts is not None
    assert isinstance(fused.model.layers[0].mlp, GatedMLP)   # below first_k_dense_replace
    assert fused.moe_layer_ids == (1, 2) and list(fused.routed_experts_weights_of_layer) == [1, 2]
    attn = fused.model.layers[0].self_attn
    assert attn.rotary_dim == 8 and attn.q_proj.bias is not None and attn.o_proj.bias is None
    lf, lu = logits_of(fused, ids), logits_of(unfused, ids)
    assert (lf - reference).abs().max().item() <= ATOL
    assert (lu - reference).abs().max().item() <= ATOL
    assert (lf - lu).abs().max().item() <= 1e-4


def test_the_rotary_part_matters(ckpt, ids, reference):
    """A model that rotated whole heads would differ: the parity above checks partial rotary for real."""
    model = load_local(ckpt)
    for layer in model.model.layers:
        layer.self_attn.rotary_dim = layer.self_attn.head_dim
    whole = dataclasses.replace(model.rotary.rope, partial_rotary_factor=1.0)
    model.rotary = type(model.rotary)(TINY["head_dim"], whole, TINY["max_position_embeddings"])
    assert (logits_of(model, ids) - reference).abs().max().item() > 1e-2


@pytest.mark.parametrize("overrides", [
    dict(use_qk_norm=False, attention_bias=False, n_group=1, topk_group=1),
    dict(norm_topk_prob=False, routed_scaling_factor=1.7, first_k_dense_replace=0),
    dict(rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0, "partial_rotary_factor": 0.25}),
], ids=["plain-attention-one-group", "no-renormalisation-all-moe", "linear-rope-quarter-rotary"])
def test_variants_match_transformers_fused_and_unfused(tmp_path, ids, overrides):
    path = make_glm4(tmp_path, seed=3, **overrides)
    want = hf_logits(path, ARCH, ids)
    for kw in ({}, {"disable_shared_experts_fusion": True}):
        model = load_local(path, **kw)
        assert model.plan.decisions["moe.shared_experts_fusion"].value is not bool(kw)
        assert (logits_of(model, ids) - want).abs().max().item() <= ATOL, kw


def test_a_config_silent_on_partial_rotary_rotates_half_of_each_head(tmp_path, ids):
    path = make_glm4(tmp_path, seed=5, drop_partial_rotary=True)
    assert "partial_rotary_factor" not in (path / "config.json").read_text()
    model = load_local(path)
    assert model.model.layers[0].self_attn.rotary_dim == TINY["head_dim"] // 2
    assert (logits_of(model, ids) - hf_logits(path, ARCH, ids)).abs().max().item() <= ATOL


def test_greedy_generation_equals_transformers(ckpt):
    prompt_ids = [3, 17, 42, 9, 100]
    ours = generate(load_local(ckpt), prompt_ids, 6)[0].tolist()
    assert ours == hf_greedy(ckpt, ARCH, prompt_ids, 6)


def test_two_shared_experts_run_unfused_as_one_wider_mlp(tmp_path, ids):
    """The gate fuses exactly one shared expert (structural): two stay an MLP twice as wide, as in transformers."""
    path = make_glm4(tmp_path, seed=7, n_shared_experts=2)
    model = load_local(path)
    d = model.plan.decisions["moe.shared_experts_fusion"]
    assert d.value is False and d.rule == "glm4_moe.structural.n_shared_experts"
    assert model.model.layers[1].mlp.shared_experts.gate_proj.weight.shape == (32, TINY["hidden_size"])
    assert (logits_of(model, ids) - hf_logits(path, ARCH, ids)).abs().max().item() <= ATOL


def test_config_refusals_name_the_field():
    base = dict(TINY, architectures=[ARCH], rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg = Glm4MoeConfig.from_hf(base)
    assert cfg.moe_layers == (1, 2) and cfg.rotary_dim == 8
    # neither transformers' GLM-4-MoE nor SGLang's reads moe_layer_freq
    assert Glm4MoeConfig.from_hf({**base, "moe_layer_freq": 2}).moe_layers == (1, 2)
    with pytest.raises(ConfigError, match="config.n_group/topk_group"):
        Glm4MoeConfig.from_hf({**base, "n_group": 3})
    with pytest.raises(ConfigError, match="config.partial_rotary_factor"):
        Glm4MoeConfig.from_hf({**base, "partial_rotary_factor": 0.1})      # 1.6 features: 1, not a pair
    with pytest.raises(ConfigError, match="config.num_experts_per_tok"):
        Glm4MoeConfig.from_hf({**base, "num_experts_per_tok": 17})
    with pytest.raises(ConfigError, match="config.n_routed_experts"):
        Glm4MoeConfig.from_hf({k: v for k, v in base.items() if k != "n_routed_experts"})
    with pytest.raises(ConfigError, match="supported: default, linear, yarn"):
        Glm4MoeConfig.from_hf({**base, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
