"""DBRX (`DbrxForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens against transformers, float32:
its fused q/k/v shown as three projections and clamped, its flattened experts shown one at a time (the down
projection transposed), LayerNorms without bias, the router's top-k weights divided by their p-norm (1, 2, or not);
the registry plans it with no shared experts from ffn_config; what it cannot run is refused by field before any plan.
EP 2 with every backend: tests/engine/parallel/test_expert_parallel.py; TP 2: test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.engine.weights import ShapeMismatch
from loadplan.plan import Keys

from engine_helpers import (DBRX_TINY, check_matches_transformers, check_refused_before_any_plan, load_local,
                            make_dbrx_checkpoint, with_config, with_tensors)

ARCH = "DbrxForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_dbrx_checkpoint(tmp_path_factory.mktemp("dbrx"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "dbrx" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.clip_qkv) == (32, 16, 0.5)
    assert model.model.norm.bias is None


@pytest.mark.parametrize("ffn", [dict(moe_normalize_expert_weights=2.0, moe_top_k=3),
                                 dict(moe_normalize_expert_weights=None)])
def test_its_variants_match_transformers(tmp_path, ids, ffn):
    # (clip_qkv stays set: transformers' DBRX cannot run without it, clamp(None, None) raises)
    path = make_dbrx_checkpoint(tmp_path / "v", ffn_config=dict(DBRX_TINY["ffn_config"], **ffn))
    check_matches_transformers(path, ARCH, ids)


def test_a_flattened_expert_matrix_of_another_size_is_refused_naming_it(ckpt, tmp_path):
    def cut(tensors):
        name = "transformer.blocks.1.ffn.experts.mlp.v1"
        tensors[name] = tensors[name][:-16].contiguous()
    with pytest.raises(ShapeMismatch, match=r"'transformer\.blocks\.1\.ffn\.experts\.mlp\.v1' has shape \[112, 32\]: "
                                            r"expected \[128, 32\]"):
        load_local(with_tensors(ckpt, tmp_path / "cut", cut))


@pytest.mark.parametrize("overrides,match", [
    (dict(ffn_config=dict(DBRX_TINY["ffn_config"], moe_top_k=9)),
     r"config\.ffn_config\.moe_top_k: 9 exceeds the number of routed experts"),
    (dict(attn_config=dict(DBRX_TINY["attn_config"], clip_qkv=-1)), r"config\.attn_config\.clip_qkv: must be > 0"),
    (dict(attn_config=dict(DBRX_TINY["attn_config"], kv_n_heads=3)), r"config\.n_heads: 4 heads must divide"),
    (dict(ffn_config=dict(DBRX_TINY["ffn_config"], ffn_act_fn={"name": "swish2"})), r"config\.ffn_config\.ffn_act_fn"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
