"""Mellum (`MellumForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens against transformers,
float32: Qwen3-MoE's layer (q/k norms, the softmax router's top-k renormalised or not) in a hybrid of windowed and
global layers, each kind with its own rotary; dense layers by mlp_layer_types; its MTP layer's tensors skipped;
token-by-token decoding; a batch decodes each row as alone; the registry plans it without shared experts; what it
cannot run is refused by field before any plan. EP 2 with every backend and TP 2: tests/engine/parallel/."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_batch_rows_decode_alone, check_decoding_token_by_token, check_matches_transformers,
                            check_refused_before_any_plan, make_mellum_checkpoint, with_config, with_tensors)

ARCH = "MellumForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_mellum_checkpoint(tmp_path_factory.mktemp("mellum"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "mellum" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [4, None, 4, None]
    assert [layer.rotary.rope.theta for layer in model.model.layers] == [10000.0, 500000.0] * 2
    assert model.moe_layer_ids == (0, 1, 2)


@pytest.mark.parametrize("config", [
    dict(norm_topk_prob=False, attention_bias=True, layer_types=None, mlp_layer_types=None, tie_word_embeddings=True),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_mellum_checkpoint(tmp_path / "v", seed=1, **config), ARCH, ids)


def test_its_mtp_layers_tensors_are_skipped(ckpt, tmp_path, ids):
    with_mtp = with_tensors(ckpt, tmp_path / "m", lambda t: t.update(
        {"mtp." + k.removeprefix("model.layers.0."): v.clone() for k, v in list(t.items())
         if k.startswith("model.layers.0.")}))
    check_matches_transformers(with_config(with_mtp, tmp_path / "c", num_mtp_layers=1), ARCH, ids)


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


@pytest.mark.parametrize("overrides,match", [
    (dict(sliding_window=None), r"config\.sliding_window: null is not supported with sliding_attention layers"),
    (dict(layer_types=["sliding_attention"] * 3), r"config\.layer_types: expected 4 entries"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     r"config\.rope_parameters: expected one object per layer type \(full_attention, sliding_attention\)"),
    (dict(num_experts_per_tok=9), r"config\.num_experts_per_tok: 9 exceeds the number of routed experts \(8\)"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
