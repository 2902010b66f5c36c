"""HY-V3 (`HYV3ForCausalLM`: Tencent's Hunyuan V3) from save_pretrained checkpoints: logits and greedy tokens against
transformers, float32: Qwen3's attention (q/k norms before the rotation, optional biases on q/k/v/o) over DeepSeek-V3's
MoE block with one group (the biased sigmoid router, router_scaling_factor), its shared experts (the checkpoint's
`mlp.shared_mlp`), dense layers by mlp_layer_types, the float32 combine or not; token-by-token decoding; a batch
decodes each row as alone; the registry plans its shared experts, never fused; what it cannot run is refused by field
before any plan. EP 2 with every backend and TP 2: tests/engine/parallel/."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (DROP, check_batch_rows_decode_alone, check_decoding_token_by_token,
                            check_matches_transformers, check_refused_before_any_plan, make_hy_v3_checkpoint,
                            with_config)

ARCH = "HYV3ForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hy_v3_checkpoint(tmp_path_factory.mktemp("hy_v3"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "hy_v3" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "hy_v3.structural.no_fused_layout"
    assert model.moe_layer_ids == (1, 2) and model.model.layers[1].mlp.fp32_combine
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0


@pytest.mark.parametrize("config", [
    dict(attention_bias=True, num_shared_experts=2, router_scaling_factor=1.0, enable_moe_fp32_combine=False,
         tie_word_embeddings=True),
    dict(mlp_layer_types=["sparse", "dense", "sparse"], num_experts_per_tok=3),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_hy_v3_checkpoint(tmp_path / "v", seed=1, **config), ARCH, ids)


def test_a_config_without_rope_fields_has_hy_v3s_theta(ckpt, tmp_path, ids):
    model = check_matches_transformers(with_config(ckpt, tmp_path / "r", rope_parameters=DROP), ARCH, ids)
    assert model.config.rope.theta == 11_158_840.0


def test_moe_layer_freq_is_not_read_as_transformers_reads_it_not(ckpt, tmp_path, ids):
    """mlp_layer_types alone says which layers are MoE (transformers and the registry's hy_v3_layout)."""
    model = check_matches_transformers(with_config(ckpt, tmp_path / "f", moe_layer_freq=2), ARCH, ids)
    assert model.moe_layer_ids == (1, 2)


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


@pytest.mark.parametrize("overrides,match", [
    (dict(mlp_bias=True), r"config\.mlp_bias: true is not supported"),
    (dict(partial_rotary_factor=0.5), r"config\.partial_rotary_factor: 0\.5 not supported"),
    (dict(mlp_layer_types=["dense", "moe", "sparse"]), r"config\.mlp_layer_types: expected 3 entries"),
    (dict(num_experts_per_tok=9), r"config\.num_experts_per_tok: 9 exceeds the number of routed experts \(8\)"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
