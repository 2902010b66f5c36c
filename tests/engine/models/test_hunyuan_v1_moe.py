"""Hunyuan MoE (`HunYuanMoEV1ForCausalLM`: Hunyuan-A13B) from save_pretrained checkpoints: logits and greedy tokens
against transformers, float32, with A13B's NTK-alpha rope (and a small alpha, which turns every feature pair), the
plain rope, tied embeddings, attention biases; its config.json as the Hub writes it (per-layer lists, rope_scaling
"dynamic" with an alpha) read alike by both; the router kept float32 in a bfloat16 model; the registry plans its
shared MLP, never fused; what it cannot run is refused by field before any plan. EP 2 with every backend: tests/
engine/parallel/test_expert_parallel.py; TP 2: test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_matches_transformers, check_refused_before_any_plan, load_local,
                            make_hunyuan_checkpoint, with_config)

ARCH = "HunYuanMoEV1ForCausalLM"
L = 3   # HUNYUAN_TINY's layers


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hunyuan_checkpoint(tmp_path_factory.mktemp("hunyuan"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "hunyuan_v1_moe" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "hunyuan_v1_moe.structural.no_fused_layout"
    layer = model.model.layers[0]
    assert layer.self_attn.qk_norm_after_rope and layer.mlp.shared_mlp.gate_proj.out_features == 16
    assert model.rotary.rope.rope_type == "ntk_alpha" and model.rotary.rope.alpha == 1000.0


@pytest.mark.parametrize("config", [
    # alpha 3: the base grows 3 ** (8 / 6), every pair of an 8-wide head still turns
    dict(rope_parameters={"rope_type": "dynamic", "alpha": 3.0, "factor": 1.0, "rope_theta": 10000.0}),
    dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
         attention_bias=True, moe_topk=3),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_hunyuan_checkpoint(tmp_path / "v", **config), ARCH, ids)


# The fields of tencent/Hunyuan-A13B-Instruct's config.json that say the model's shape, as it writes them: per-layer
# lists, the rope as "dynamic" with an alpha, switches of Tencent's own modeling code (sizes are HUNYUAN_TINY's).
HUB_STYLE = dict(moe_topk=[2] * L, num_shared_expert=[1] * L, moe_intermediate_size=[16] * L, use_qk_norm=True,
                 use_mixed_mlp_moe=True, use_cla=False, mlp_bias=False, attention_head_dim=8, rope_parameters=None,
                 rope_theta=10000.0, rope_scaling={"alpha": 3.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0,
                                                   "mscale": 1.0, "mscale_all_dim": 1.0, "type": "dynamic"})


def test_the_hubs_config_json_is_read_as_transformers_reads_it(tmp_path, ids):
    base = make_hunyuan_checkpoint(tmp_path / "base", rope_parameters={"rope_type": "dynamic", "alpha": 3.0,
                                                                       "factor": 1.0, "rope_theta": 10000.0})
    model = check_matches_transformers(with_config(base, tmp_path / "hub", **HUB_STYLE), ARCH, ids)
    assert model.config.num_experts_per_tok == 2 and model.rotary.rope.alpha == 3.0


def test_the_router_stays_float32_in_a_bfloat16_model(ckpt, ids):
    model = load_local(ckpt, dtype=torch.bfloat16)
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.dtype == torch.float32 and moe.shared_mlp.gate_proj.weight.dtype == torch.bfloat16
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    assert moe.router_logits(x).dtype == torch.float32
    assert torch.isfinite(model(ids)).all()


@pytest.mark.parametrize("overrides,match", [
    (dict(use_cla=True), r"config\.use_cla: True is not supported"),
    (dict(use_qk_norm=False), r"config\.use_qk_norm: False is not supported"),
    (dict(use_mixed_mlp_moe=False), r"config\.use_mixed_mlp_moe: false: SGLang builds no shared MLP"),
    (dict(moe_topk=[2, 2, 3]), r"config\.moe_topk: per-layer values \[2, 3\] differ"),
    (dict(moe_topk=[2, 2]), r"config\.moe_topk: expected one value per layer \(3\), got 2"),
    (dict(moe_topk=9), r"config\.moe_topk: 9 exceeds the number of routed experts \(8\)"),
    (dict(moe_intermediate_size=[24] * L), r"config\.moe_intermediate_size: 24 differs from intermediate_size=16"),
    (dict(num_shared_expert=[2] * L), r"config\.num_shared_expert: not 1: transformers builds one shared MLP"),
    (dict(moe_layer_num_skipped=1), r"config\.moe_layer_num_skipped: 1 is not supported"),
    (dict(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}),
     r"config\.rope_scaling: rope type 'dynamic' not supported; supported: .*dynamic \(with alpha\)"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
