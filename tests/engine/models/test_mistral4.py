"""Mistral 4 (`Mistral4ForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens against transformers,
float32: DeepSeek-V3's MLA whose queries are scaled by their position past the rope's original context (Llama 4's
long-context scaling), the softmax router in groups without a routing bias, shared experts never fused, the stacked
experts transformers saves; variants (no q LoRA, biases, unrotated pairs, one group, transformers' default YaRN);
token-by-token decoding past the original context; a batch decodes each row as alone; what it cannot run is refused by
field before any plan. EP 2 with every backend and TP 2: tests/engine/parallel/."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (MISTRAL4_TINY, check_batch_rows_decode_alone, check_decoding_token_by_token,
                            check_matches_transformers, check_refused_before_any_plan, make_mistral4_checkpoint,
                            with_config)

ARCH = "Mistral4ForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_mistral4_checkpoint(tmp_path_factory.mktemp("mistral4"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "mistral4" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "deepseek.structural.architecture"
    assert model.moe_layer_ids == (1, 2)
    gate = model.model.layers[1].mlp.gate
    assert gate.scoring == "softmax" and gate.e_score_correction_bias is None and gate.n_group == 2
    assert model.model.layers[0].self_attn.query_position_scale == (0.3, 4)


@pytest.mark.parametrize("config", [
    dict(q_lora_rank=None, attention_bias=True, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False,
         n_shared_experts=2),
    dict(rope_parameters=None, first_k_dense_replace=0, tie_word_embeddings=True),     # transformers' default YaRN
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_mistral4_checkpoint(tmp_path / "v", seed=1, **config), ARCH, ids)


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    """Past the 4 original positions each cached query is scaled by its own position."""
    check_decoding_token_by_token(ckpt, ARCH, ids, prefill=2)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


ROPE = MISTRAL4_TINY["rope_parameters"]


@pytest.mark.parametrize("overrides,match", [
    (dict(rope_parameters={k: v for k, v in ROPE.items() if k != "llama_4_scaling_beta"}),
     r"config\.rope_parameters\.llama_4_scaling_beta: expected a number, got None"),
    (dict(rope_parameters=dict(ROPE, partial_rotary_factor=0.25)),
     r"config\.rope_parameters\.partial_rotary_factor: 0\.25 of a 16-wide head rotates 4 features, not "
     r"qk_rope_head_dim=8"),
    (dict(rope_parameters={k: v for k, v in ROPE.items() if k != "original_max_position_embeddings"}),
     r"config\.rope_parameters\.original_max_position_embeddings: expected a positive integer"),
    (dict(num_experts_per_tok=9), r"config\.num_experts_per_tok: 9 exceeds the number of routed experts \(8\)"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), r"config\.rope_scaling: not read by Mistral 4"),
    (dict(rope_parameters=dict(ROPE, rope_type="dynamic")), r"config\.rope_parameters: rope type 'dynamic' not "
                                                            r"supported"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
