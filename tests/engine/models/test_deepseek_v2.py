"""DeepSeek-V2 from save_pretrained checkpoints: logits against transformers, float32 (never fused)."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.generate import generate
from loadplan.engine.layers.deepseek_v2_router import DeepseekV2Router
from loadplan.engine.models.deepseek_v3 import ConfigError, DeepseekV3Config, DeepseekV3MoE

from engine_helpers import GLM4_TINY
from engine_helpers import DEEPSEEK_V2_TINY as TINY
from engine_helpers import (hf_greedy, hf_logits, hf_logits_of_order_one, load_local, logits_of,
                            make_deepseek_v2_checkpoint, make_plan, prompt)

transformers = pytest.importorskip("transformers")

ARCH = "DeepseekV2ForCausalLM"
ATOL = 1e-3
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_deepseek_v2_checkpoint(tmp_path_factory.mktemp("dsv2"), **TINY)


@pytest.fixture(scope="module")
def ids():
    return prompt(T=9)


def test_group_limited_greedy_matches_transformers_and_is_never_fused(ckpt, ids):
    want = hf_logits_of_order_one(ckpt, ARCH, ids)
    model = load_local(ckpt)
    d = model.plan.decisions["moe.shared_experts_fusion"]
    assert d.value is False and d.rule == "deepseek.structural.architecture", d
    mlp = model.model.layers[1].mlp
    assert isinstance(mlp.gate, DeepseekV2Router) and mlp.gate.topk_method == "group_limited_greedy"
    assert mlp.experts.gate_up_proj.shape[0] == 16 and mlp.shared_experts.gate_proj.weight.shape == (32, 32)
    assert model.moe_layer_ids == (1, 2) and list(model.routed_experts_weights_of_layer) == [1, 2]
    assert (logits_of(model, ids) - want).abs().max().item() <= ATOL


@pytest.mark.parametrize("overrides", [
    dict(topk_method="greedy", n_group=None, topk_group=None, q_lora_rank=None),
    dict(rope_parameters=YARN, routed_scaling_factor=1.0, first_k_dense_replace=0),
    dict(topk_group=1, num_experts_per_tok=6),     # 4 experts left for 6 picks: zeros are picked, weight 0
], ids=["greedy-no-q-lora", "yarn-all-moe", "fewer-experts-left-than-top-k"])
def test_variants_match_transformers(tmp_path, ids, overrides):
    path = make_deepseek_v2_checkpoint(tmp_path, seed=2, **dict(TINY, **overrides))
    want = hf_logits(path, ARCH, ids)
    assert (logits_of(load_local(path), ids) - want).abs().max().item() <= ATOL


def test_greedy_generation_equals_transformers(ckpt):
    prompt_ids = [3, 17, 42, 9, 100]
    ours = generate(load_local(ckpt), prompt_ids, 6)[0].tolist()
    assert ours == hf_greedy(ckpt, ARCH, prompt_ids, 6)


def test_a_plan_that_fuses_is_refused_by_the_v2_block():
    """The registry never fuses V2; were a plan to (another family's, of as many experts), the layer says so."""
    v2 = DeepseekV3Config.from_hf(dict(TINY, n_shared_experts=1, rope_theta=10000.0), ARCH)
    plan = make_plan(dict(GLM4_TINY, architectures=["Glm4MoeForCausalLM"], rope_theta=10000.0))
    assert plan.decisions["moe.num_fused_shared_experts"].value == 1
    with pytest.raises(ValueError, match="DeepSeek-V2's router has no fused slot"):
        DeepseekV3MoE(v2, plan, 1, torch.float32)


def test_config_refusals_name_the_field():
    base = dict(TINY, rope_theta=10000.0)
    cfg = DeepseekV3Config.from_hf(base, ARCH)
    assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob, cfg.rope_interleave) == \
        ("softmax", "group_limited_greedy", False, True)
    assert DeepseekV3Config.from_hf({k: v for k, v in base.items() if k != "topk_method"}, ARCH).topk_method == \
        "greedy"                                      # transformers' default
    with pytest.raises(ConfigError, match="config.topk_method: 'noaux_tc' not supported; supported: greedy, "
                                          "group_limited_greedy"):
        DeepseekV3Config.from_hf({**base, "topk_method": "noaux_tc"}, ARCH)
    with pytest.raises(ConfigError, match="config.scoring_func: 'sigmoid' not supported; supported: softmax"):
        DeepseekV3Config.from_hf({**base, "scoring_func": "sigmoid"}, ARCH)
    with pytest.raises(ConfigError, match="config.norm_topk_prob: true not supported"):
        DeepseekV3Config.from_hf({**base, "norm_topk_prob": True}, ARCH)
    with pytest.raises(ConfigError, match="config.moe_layer_freq: 2 makes layers"):
        DeepseekV3Config.from_hf({**base, "moe_layer_freq": 2}, ARCH)
    with pytest.raises(ConfigError, match="config.mlp_bias"):
        DeepseekV3Config.from_hf({**base, "mlp_bias": True}, ARCH)
