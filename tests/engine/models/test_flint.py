"""Flint (`FlintForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens against transformers, float32:
Qwen3-MoE's layer with a sink logit per head on every layer (the checkpoint's `softmax_offset`), windowed layers
rotated beside global NoPE ones, float32 router logits whose sigmoid top-k is renormalised, an ungated shared expert
never fused; dense layers by mlp_only_layers / decoder_sparse_step; token-by-token decoding; a batch decodes each row
as alone; what it cannot run is refused by field before any plan. EP 2 with every backend and TP 2:
tests/engine/parallel/."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_batch_rows_decode_alone, check_decoding_token_by_token, check_matches_transformers,
                            check_refused_before_any_plan, make_flint_checkpoint, with_config)

ARCH = "FlintForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_flint_checkpoint(tmp_path_factory.mktemp("flint"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "flint" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "flint.structural.no_fused_layout"
    attn = [layer.self_attn for layer in model.model.layers]
    assert [(a.sliding_window, a.use_rope, a.sinks is not None) for a in attn] == [(None, False, True),
                                                                                   (4, True, True)] * 2
    assert model.moe_layer_ids == (1, 2, 3) and model.model.layers[1].mlp.shared_mlp is not None


@pytest.mark.parametrize("config", [
    dict(norm_topk_prob=False, attention_bias=True, mlp_only_layers=[], decoder_sparse_step=2, layer_types=None,
         tie_word_embeddings=True),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_flint_checkpoint(tmp_path / "v", seed=1, **config), ARCH, ids)


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


@pytest.mark.parametrize("overrides,match", [
    (dict(sliding_window=0), r"config\.sliding_window: must be >= 1"),
    (dict(layer_types=["full_attention"] * 3), r"config\.layer_types: expected 4 entries"),
    (dict(decoder_sparse_step=0), r"config\.decoder_sparse_step: must be >= 1"),
    (dict(partial_rotary_factor=0.5), r"config\.rope_parameters: partial_rotary_factor 0\.5 is not supported"),
    (dict(num_experts_per_tok=9), r"config\.num_experts_per_tok: 9 exceeds the number of routed experts \(8\)"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
