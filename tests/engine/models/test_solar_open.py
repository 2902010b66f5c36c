"""Solar Open (`SolarOpenForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens against
transformers, float32: Llama's attention (whole heads rotated, q/k/v biases with attention_bias) over GLM-4-MoE's MoE
block on every layer (the grouped sigmoid router, a shared expert beside the routed ones); a tied head;
token-by-token decoding; a batch decodes each row as alone; the registry plans it unfused; what it cannot run is
refused by field before any plan. EP 2 with every backend and TP 2: tests/engine/parallel/."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_batch_rows_decode_alone, check_decoding_token_by_token, check_matches_transformers,
                            check_refused_before_any_plan, make_solar_open_checkpoint, with_config)

ARCH = "SolarOpenForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_solar_open_checkpoint(tmp_path_factory.mktemp("solar_open"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "solar_open" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert model.moe_layer_ids == (0, 1, 2) and model.model.layers[0].mlp.shared_experts is not None
    attn = model.model.layers[0].self_attn
    assert attn.rotary_dim == 8 and attn.q_norm is None


def test_with_biases_and_a_tied_head_it_matches_transformers(tmp_path, ids):
    check_matches_transformers(make_solar_open_checkpoint(tmp_path / "v", seed=2, attention_bias=True,
                                                          tie_word_embeddings=True), ARCH, ids)


def test_deepseeks_layer_fields_are_not_read_as_transformers_reads_neither(ckpt, tmp_path, ids):
    """Every layer is MoE (transformers, and the registry's solar_open_layout), whatever first_k_dense_replace and
    moe_layer_freq say."""
    model = check_matches_transformers(with_config(ckpt, tmp_path / "f", first_k_dense_replace=1, moe_layer_freq=2),
                                       ARCH, ids)
    assert model.moe_layer_ids == (0, 1, 2)


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


@pytest.mark.parametrize("overrides,match", [
    (dict(num_nextn_predict_layers=1), r"config\.num_nextn_predict_layers: 1 not supported; Solar Open runs 0"),
    (dict(use_qk_norm=True), r"config\.use_qk_norm: True not supported; Solar Open runs False"),
    (dict(partial_rotary_factor=0.5), r"config\.partial_rotary_factor: 0\.5 not supported"),
    (dict(num_experts_per_tok=9), r"config\.num_experts_per_tok: 9 exceeds the number of routed experts \(8\)"),
    (dict(n_group=3), r"config\.n_group/topk_group: 3/1 do not split 8 experts into groups"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
