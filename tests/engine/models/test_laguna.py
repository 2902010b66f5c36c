"""Laguna (`LagunaForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens against transformers,
float32: a head count per layer, windowed layers beside global ones each with its kind's rotary (half of each global
head rotated by default), q/k norms, softplus output gates (per head or per feature), the biased sigmoid router with
soft-capped logits and its scaling factor, a shared expert of its own width (never fused); token-by-token decoding; a
batch decodes each row as alone; what it cannot run is refused by field before any plan. EP 2 with every backend and
TP 2: tests/engine/parallel/."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_batch_rows_decode_alone, check_decoding_token_by_token, check_matches_transformers,
                            check_refused_before_any_plan, make_laguna_checkpoint, with_config)

ARCH = "LagunaForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_laguna_checkpoint(tmp_path_factory.mktemp("laguna"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "laguna" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "laguna.structural.no_fused_layout"
    attn = [layer.self_attn for layer in model.model.layers]
    assert [(a.n_heads, a.sliding_window, a.rotary_dim) for a in attn] == \
        [(4, None, 4), (8, 4, 8), (8, 4, 8), (4, None, 4)]
    assert all(a.gate_per_head and a.gate_activation == "softplus" for a in attn)
    assert model.moe_layer_ids == (1, 2, 3) and model.model.layers[1].mlp.gate.logit_softcap == 2.0


@pytest.mark.parametrize("config", [
    # a gate a feature, biases, no soft cap, unscaled, the default ropes, every layer global
    dict(gating="per-element", attention_bias=True, moe_router_logit_softcapping=0.0, moe_routed_scaling_factor=1.0,
         rope_parameters=None, layer_types=None, num_attention_heads_per_layer=None),
    dict(mlp_layer_types=["sparse"] * 4, num_experts_per_tok=3, tie_word_embeddings=True),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_laguna_checkpoint(tmp_path / "v", seed=1, **config), ARCH, ids)


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


@pytest.mark.parametrize("overrides,match", [
    (dict(moe_apply_router_weight_on_input=True), r"config\.moe_apply_router_weight_on_input: true is not supported"),
    (dict(num_attention_heads_per_layer=[4, 8]), r"config\.num_attention_heads_per_layer: expected 4 positive"),
    (dict(gating="per-group"), r"config\.gating: 'per-group' is not supported"),
    (dict(moe_router_logit_softcapping=-1.0), r"config\.moe_router_logit_softcapping: must be >= 0"),
    (dict(layer_types=["full_attention", "chunked_attention", "full_attention", "full_attention"]),
     r"config\.layer_types: expected 4 entries of full_attention, sliding_attention"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
