"""LFM2-MoE (`Lfm2MoeForCausalLM`: LFM2-8B-A1B) from save_pretrained checkpoints: logits and greedy tokens (decoded
through the conv layers' cache) against transformers, float32: short-conv and attention layers, a dense layer, the
sigmoid router with its routing bias, renormalised and scaled; without the bias or the renormalisation, with conv
biases and an untied head; a batch decodes each row as alone; speculative decoding with an LFM2-MoE target rolls its
conv layers back to the last accepted position; the registry plans it with no shared experts; what it cannot run is
refused by field before any plan (tensor parallelism too). EP 2 with every backend: tests/engine/parallel/
test_expert_parallel.py."""

from __future__ import annotations

import pytest

from loadplan.engine.layers.attention import GQAttention
from loadplan.engine.layers.short_conv import ShortConv
from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_batch_rows_decode_alone, check_matches_transformers, check_refused_before_any_plan,
                            check_speculative_target_rolls_back, make_lfm2_moe_checkpoint, with_config)

ARCH = "Lfm2MoeForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_lfm2_moe_checkpoint(tmp_path_factory.mktemp("lfm2_moe"))





def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "lfm2_moe" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert [type(layer.mixer) for layer in model.model.layers] == [ShortConv, GQAttention] * 2
    assert model.moe_layer_ids == (1, 2, 3) and model.model.layers[1].mlp.expert_bias.abs().sum() > 0


@pytest.mark.parametrize("config", [
    dict(use_expert_bias=False, norm_topk_prob=False, routed_scaling_factor=1.0),
    dict(conv_bias=True, tie_word_embeddings=False, conv_L_cache=4, num_dense_layers=0),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_lfm2_moe_checkpoint(tmp_path / "v", **config), ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


def test_speculative_decoding_with_an_lfm2_moe_target_gives_its_greedy_tokens(tmp_path):
    """Its conv layers continue from the inputs of the last accepted position."""
    check_speculative_target_rolls_back(make_lfm2_moe_checkpoint(tmp_path / "target", tie_word_embeddings=False),
                                        tmp_path / "draft", 0.3)


@pytest.mark.parametrize("overrides,match", [
    (dict(layer_types=None), r"config\.layer_types: missing"),
    (dict(layer_types=["conv", "sliding_attention", "conv", "full_attention"]), r"config\.layer_types: expected 4"),
    (dict(conv_L_cache=0), r"config\.conv_L_cache: must be >= 1"),
    (dict(num_dense_layers=-1), r"config\.num_dense_layers: must be >= 0, got -1"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)


def test_tensor_parallelism_is_refused_before_any_plan(ckpt):
    check_refused_before_any_plan(ckpt, NotImplementedError, r"tensor parallelism \(tp_size=2\) is not implemented "
                                                             r"by the engine for Lfm2MoeForCausalLM", tp_size=2)
