"""EXAONE-MoE (`ExaoneMoeForCausalLM`: K-EXAONE) from save_pretrained checkpoints: logits and greedy tokens against
transformers, float32: windowed layers (rotated) beside global NoPE ones, by pattern and by explicit layer_types;
DeepSeek-V3's router with its routing bias (stored as `mlp.e_score_correction_bias`) and groups; dense layers by
mlp_layer_types; two shared experts; the registry plans its shared experts, never fused; what it cannot run is
refused by field before any plan. EP 2 with every backend: tests/engine/parallel/test_expert_parallel.py; TP 2:
test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_matches_transformers, check_refused_before_any_plan, make_exaone_moe_checkpoint,
                            with_config)

ARCH = "ExaoneMoeForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_exaone_moe_checkpoint(tmp_path_factory.mktemp("exaone_moe"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "exaone_moe" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "exaone_moe.structural.no_fused_layout"
    attn = [layer.self_attn for layer in model.model.layers]
    # sliding_window_pattern 2: layers 0 and 2 windowed (and rotated), 1 and 3 global without rotation
    assert [(a.sliding_window, a.use_rope) for a in attn] == [(4, True), (None, False)] * 2
    assert model.moe_layer_ids == (1, 2, 3)                      # first_k_dense_replace 1
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0


@pytest.mark.parametrize("config", [
    dict(layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"], sliding_window=3),
    dict(mlp_layer_types=["dense", "sparse", "dense", "sparse"], n_group=1, topk_group=1, num_shared_experts=2,
         norm_topk_prob=False, tie_word_embeddings=True),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_exaone_moe_checkpoint(tmp_path / "v", **config), ARCH, ids)


@pytest.mark.parametrize("overrides,match", [
    (dict(sliding_window=None), r"config\.sliding_window: null is not supported"),
    (dict(sliding_window_pattern=0, layer_types=None), r"config\.sliding_window_pattern: must be >= 1"),
    (dict(layer_types=["full_attention"] * 3), r"config\.layer_types: expected 4 entries"),
    (dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), r"config\.mlp_layer_types: expected 4 entries"),
    (dict(attention_bias=True), r"config\.attention_bias: true is not supported"),
    (dict(partial_rotary_factor=0.5), r"config\.partial_rotary_factor: 0\.5 not supported"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
