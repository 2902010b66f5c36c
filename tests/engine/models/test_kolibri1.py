"""Kolibri-1 (`Kolibri1ForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens against transformers,
float32: Qwen3-MoE's attention in windowed (rotated) and global (NoPE) layers; sandwich norms; a router whose top-k is
chosen on its logits plus the routing bias and weighted by their sigmoid, renormalised or not; an ungated shared
expert never fused; token-by-token decoding; a batch decodes each row as alone; what it cannot run is refused by field
before any plan. EP 2 with every backend and TP 2: tests/engine/parallel/."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_batch_rows_decode_alone, check_decoding_token_by_token, check_matches_transformers,
                            check_refused_before_any_plan, make_kolibri1_checkpoint, with_config)

ARCH = "Kolibri1ForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_kolibri1_checkpoint(tmp_path_factory.mktemp("kolibri1"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "kolibri1" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "kolibri1.structural.no_fused_layout"
    attn = [layer.self_attn for layer in model.model.layers]
    assert [(a.sliding_window, a.use_rope) for a in attn] == [(4, True), (None, False), (4, True)]
    assert model.model.layers[0].mlp.e_score_correction_bias.abs().sum() > 0


@pytest.mark.parametrize("config", [
    # transformers' default layer kinds (the last of 5 global), the sigmoid weights as they are, a tied head
    dict(num_hidden_layers=5, layer_types=None, norm_topk_prob=False, tie_word_embeddings=True),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    model = check_matches_transformers(make_kolibri1_checkpoint(tmp_path / "v", seed=1, **config), ARCH, ids)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [True] * 4 + [False]


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


@pytest.mark.parametrize("overrides,match", [
    (dict(sliding_window=None), r"config\.sliding_window: null is not supported"),
    (dict(layer_types=["sliding_attention"] * 2), r"config\.layer_types: expected 3 entries"),
    (dict(partial_rotary_factor=0.5), r"config\.rope_parameters: partial_rotary_factor 0\.5 is not supported"),
    (dict(num_experts_per_tok=9), r"config\.num_experts_per_tok: 9 exceeds the number of routed experts \(8\)"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
