"""A.X K1 (`AXK1ForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens against transformers, float32:
DeepSeek-V3's MLA and grouped router with its routing bias, shared experts, and the MoE layers' output norm
(`post_mlp_layernorm`); MoE layers by mlp_layer_types or DeepSeek's first_k_dense_replace; token-by-token decoding; a
batch decodes each row as alone; the registry plans its shared experts, never fused; what it cannot run is refused by
field before any plan. EP 2 with every backend and TP 2: tests/engine/parallel/."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (DROP, check_batch_rows_decode_alone, check_decoding_token_by_token,
                            check_matches_transformers, check_refused_before_any_plan, make_axk1_checkpoint,
                            with_config)

ARCH = "AXK1ForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_axk1_checkpoint(tmp_path_factory.mktemp("axk1"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "axk1" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "deepseek.structural.architecture"
    assert model.moe_layer_ids == (1, 3)
    assert [layer.post_mlp_layernorm is not None for layer in model.model.layers] == [False, True, False, True]


def test_its_variants_match_transformers(tmp_path, ids):
    """Unrotated pairs, biases, two shared experts; its MoE layers said by DeepSeek's first_k_dense_replace in a
    config.json without mlp_layer_types (transformers derives them alike)."""
    saved = make_axk1_checkpoint(tmp_path / "v", seed=1, mlp_layer_types=None, first_k_dense_replace=2,
                                 rope_interleave=False, attention_bias=True, n_shared_experts=2)
    derived = with_config(saved, tmp_path / "d", mlp_layer_types=DROP, first_k_dense_replace=2)
    model = check_matches_transformers(derived, ARCH, ids)
    assert model.moe_layer_ids == (2, 3)


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


@pytest.mark.parametrize("overrides,match", [
    (dict(q_lora_rank=None), r"config\.q_lora_rank: null is not supported"),
    (dict(mlp_layer_types=["dense", "moe", "dense", "sparse"]), r"config\.mlp_layer_types: expected 4 entries"),
    (dict(mlp_layer_types=DROP, moe_layer_freq=0), r"config\.moe_layer_freq: must be >= 1"),
    (dict(n_group=3), r"config\.n_group/topk_group: 3/1 do not split 8 experts into groups"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
