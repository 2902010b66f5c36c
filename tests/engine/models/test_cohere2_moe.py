"""Cohere2-MoE (`Cohere2MoeForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens against
transformers, float32: the parallel block (one norm feeding attention and MoE), LayerNorm or RMSNorm, Cohere's
interleaved rotary on windowed layers (and on the dense prefix layer, as transformers forces it) beside global NoPE
ones, a router that scores its top-k logits (softmax, or sigmoid renormalised or not), shared experts averaged with or
summed to the routed ones, the logit scale, tied or untied heads; token-by-token decoding; a batch decodes each row
as alone; speculative rollback; the registry plans its shared experts, never fused; what it cannot run is refused by
field before any plan. EP 2 with every backend and TP 2: tests/engine/parallel/."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (DROP, check_batch_rows_decode_alone, check_decoding_token_by_token,
                            check_matches_transformers, check_refused_before_any_plan,
                            check_speculative_target_rolls_back, make_cohere2_moe_checkpoint, with_config)

ARCH = "Cohere2MoeForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_cohere2_moe_checkpoint(tmp_path_factory.mktemp("cohere2_moe"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "cohere2_moe" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "cohere2_moe.structural.no_fused_layout"
    attn = [layer.self_attn for layer in model.model.layers]
    # layer 0: the dense prefix (global, yet rotated); then windowed (rotated) and global NoPE layers by pattern 2
    assert [(a.sliding_window, a.use_rope, a.rope_interleave) for a in attn] == \
        [(None, True, True), (4, True, True), (None, False, True), (4, True, True)]
    assert model.moe_layer_ids == (1, 2, 3) and model.model.layers[1].mlp.shared_average
    assert all(layer.post_attention_layernorm is None for layer in model.model.layers)
    assert model.lm_head is None                                  # tied


@pytest.mark.parametrize("config", [
    # RMSNorm, sigmoid scores renormalised, shared experts summed, untied head with biases, 2 shared experts
    dict(rms_norm_eps=1e-6, expert_selection_fn="sigmoid", shared_expert_combination_strategy="sum",
         tie_word_embeddings=False, attention_bias=True, num_shared_experts=2),
    # sigmoid scores as they are, no shared expert, no dense layer, explicit layer kinds, a prefix pattern of 2
    dict(expert_selection_fn="sigmoid", norm_topk_prob=False, num_shared_experts=0, first_k_dense_replace=0,
         layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"], sliding_window=3),
    dict(first_k_dense_replace=2, prefix_dense_sliding_window_pattern=2, num_experts_per_tok=3),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_cohere2_moe_checkpoint(tmp_path / "v", seed=1, **config), ARCH, ids)


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


def test_as_a_speculative_target_it_rolls_back_rejected_drafts(tmp_path):
    check_speculative_target_rolls_back(make_cohere2_moe_checkpoint(tmp_path / "t", tie_word_embeddings=False),
                                        tmp_path / "d", noise=0.5)


@pytest.mark.parametrize("overrides,match", [
    (dict(sliding_window=None), r"config\.sliding_window: null is not supported with sliding_attention layers"),
    (dict(sliding_window_pattern=0, layer_types=DROP), r"config\.sliding_window_pattern: must be >= 1"),
    (dict(layer_types=["full_attention"] * 3), r"config\.layer_types: expected 4 entries"),
    (dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), r"config\.mlp_layer_types: expected 4 entries"),
    (dict(shared_expert_combination_strategy="max"),
     r"config\.shared_expert_combination_strategy: 'max' is not supported; one of sum, average"),
    (dict(expert_selection_fn="sparsemixer"), r"config\.expert_selection_fn: 'sparsemixer' is not supported"),
    (dict(partial_rotary_factor=0.5), r"config\.partial_rotary_factor: 0\.5 not supported"),
    (dict(num_experts_per_tok=9), r"config\.num_experts_per_tok: 9 exceeds the number of routed experts \(8\)"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
