"""Step-3.5 (`Step3p5ForCausalLM`) and Step-3.7 run text-only (`Step3p7ForConditionalGeneration`) from
save_pretrained checkpoints: logits and greedy tokens against transformers' Step-3.7 in float32 (transformers has no
Step-3.5 class: a Step-3.5 checkpoint here is the Step-3.7 one's text model, as Step-3.5's own checkpoints spell it):
offset norms, windowed layers with their own head count and rotary beside global ones rotating part of each head,
per-head output gates, the softmax scale, the biased sigmoid router scaled, the shared expert, SwiGLU
clamps on experts, shared expert and dense MLP; the Hub's older config fields (moe_layers_enum,
attention_other_setting, rope_theta and partial_rotary_factors per layer, lists padded with the MTP layers, whose
tensors are skipped); token-by-token decoding; a batch decodes each row as alone; speculative rollback; the registry
plans its shared expert, never fused; what it cannot run is refused by field before any plan. EP 2 with every
backend and TP 2: tests/engine/parallel/."""

from __future__ import annotations

import json

import pytest
import torch

from loadplan.engine.generate import generate
from loadplan.engine.models.config import ConfigError
from loadplan.engine.models.step3p5 import FIXED_FIELDS
from loadplan.plan import Keys

from engine_helpers import (DROP, check_batch_rows_decode_alone, check_decoding_token_by_token,
                            check_matches_transformers, check_refused_before_any_plan,
                            check_speculative_target_rolls_back, hf_greedy, hf_logits_of_order_one, load_local,
                            logits_of, make_fp8_copies, make_step3p5_checkpoint, with_config, with_tensors)

WRAPPER = "Step3p7ForConditionalGeneration"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return make_step3p5_checkpoint(tmp_path_factory.mktemp("step3p5"))


def check_step3p5_matches_transformers(text: object, full: object, ids: torch.Tensor, tol: float = 1e-4):
    """The engine's Step-3.5 model of `text` gives transformers' Step-3.7 logits of `full` (the checkpoint it was cut
    from) and its greedy tokens; returns the model."""
    model = load_local(text)
    assert (logits_of(model, ids) - hf_logits_of_order_one(full, WRAPPER, ids)).abs().max().item() <= tol
    assert generate(model, ids[0], 6)[0].tolist() == hf_greedy(full, WRAPPER, ids[0].tolist(), 6)
    return model


def test_logits_and_greedy_tokens_match_transformers(ckpts, ids):
    text, full = ckpts
    model = check_step3p5_matches_transformers(text, full, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "step3p5" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "step3p5.structural.no_fused_layout"
    attn = [layer.self_attn for layer in model.model.layers]
    assert [(a.n_heads, a.sliding_window, a.rotary_dim) for a in attn] == \
        [(4, None, 4), (8, 4, 8), (8, 4, 8), (4, None, 4)]
    assert all(a.gate_per_head and abs(a.scale - 12 ** -0.5) < 1e-12 for a in attn)
    assert model.moe_layer_ids == (1, 2, 3)
    layer2 = model.model.layers[2].mlp
    assert layer2.experts.activation.limit == 0.02 and layer2.shared_experts.limit == 0.02
    assert model.model.layers[0].mlp.limit == 0.05 and model.model.layers[1].mlp.experts.activation is None


def test_step3p7_run_text_only_matches_transformers(ckpts, ids):
    model = check_matches_transformers(ckpts[1], WRAPPER, ids)
    assert model.plan.decisions[Keys.ENTRY_FAMILY].value == "step3p5"


@pytest.mark.parametrize("text", [
    # biases on the attention, no clamps, one layer kind with whole heads rotated; text_config's tie_word_embeddings,
    # which transformers' Step-3.7 does not read (its own config's decides: absent, untied)
    dict(attention_bias=True, swiglu_limits=None, swiglu_limits_shared=None,
         tie_word_embeddings=True, layer_types=["sliding_attention"] * 4, rope_parameters=None),
    # the default scale (head_dim), the unscaled router, every layer MoE, 3 experts a token
    dict(query_pre_attn_scalar=None, moe_router_scaling_factor=1.0, mlp_layer_types=["sparse"] * 4,
         num_experts_per_tok=3, num_sliding_attention_heads=4),
])
def test_its_variants_match_transformers(tmp_path, ids, text):
    check_matches_transformers(make_step3p5_checkpoint(tmp_path, seed=1, **text)[1], WRAPPER, ids)


def test_the_hubs_older_fields_and_its_mtp_layers_read_as_transformers_reads_them(ckpts, tmp_path, ids):
    """Step-3.5-Flash's config.json spells its layers the older way: MoE layers by moe_layers_enum, the windowed
    layers' heads under attention_other_setting, rope_theta and partial_rotary_factors per layer, its older names
    (num_attention_groups, moe_num_experts, moe_top_k), the switches transformers does not read (at the values it
    runs), and per-layer lists that also cover its Multi-Token-Prediction layers, whose tensors (model.layers.{L}.) it
    stores: the same model."""
    text, full = ckpts
    cfg = json.loads((text / "config.json").read_text())
    mtp_layer = "model.layers.4."
    older = with_tensors(text, tmp_path / "older", lambda t: t.update(
        {mtp_layer + k.removeprefix("model.layers.1."): v.clone() for k, v in list(t.items())
         if k.startswith("model.layers.1.")}))
    thetas, factors = [10000.0, 500.0, 500.0, 10000.0, 10000.0], [0.5, 1.0, 1.0, 0.5, 0.5]
    legacy = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "mlp_layer_types", "per_layer_config",
                                                       "num_sliding_attention_heads")}
    legacy.update(num_nextn_predict_layers=1, layer_types=cfg["layer_types"] + ["full_attention"],
                  swiglu_limits=cfg["swiglu_limits"] + [0], swiglu_limits_shared=cfg["swiglu_limits_shared"] + [0],
                  moe_layers_enum="1,2,3,4", attention_other_setting={"num_attention_heads": 8},
                  rope_theta=thetas, partial_rotary_factors=factors,
                  num_attention_groups=legacy.pop("num_key_value_heads"),
                  moe_num_experts=legacy.pop("n_routed_experts"), moe_top_k=legacy.pop("num_experts_per_tok"),
                  **FIXED_FIELDS)
    (older / "config.json").write_text(json.dumps(legacy))
    model = check_step3p5_matches_transformers(older, full, ids)
    assert model.config.num_nextn_predict_layers == 1 and model.moe_layer_ids == (1, 2, 3)


def test_a_block_fp8_copy_with_stacked_experts_matches_transformers_on_its_weights(ckpts, ids, tmp_path):
    """Step-3.5-Flash-FP8's form: every projection in FP8 blocks, each layer's stacked experts matrix by matrix (their
    scales stacked too, [E, ...]); transformers' Step-3.7 runs the same weights dequantized."""
    fp8, dequantized, n = make_fp8_copies(ckpts[1], tmp_path, [8, 8])
    model = load_local(fp8)
    assert model.plan.quantization == "fp8" and n > 3 * 3        # at least the three MoE layers' three stacks
    want = hf_logits_of_order_one(dequantized, WRAPPER, ids)
    assert (logits_of(model, ids) - want).abs().max().item() <= 1e-4
    assert generate(model, ids[0], 6)[0].tolist() == hf_greedy(dequantized, WRAPPER, ids[0].tolist(), 6)


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpts, ids):
    check_decoding_token_by_token(ckpts[1], WRAPPER, ids)


def test_a_batch_decodes_each_row_as_alone(ckpts, ids):
    check_batch_rows_decode_alone(ckpts[0], ids)


def test_as_a_speculative_target_it_rolls_back_rejected_drafts(ckpts, tmp_path):
    check_speculative_target_rolls_back(ckpts[0], tmp_path / "d", noise=0.5)


@pytest.mark.parametrize("overrides,match", [
    (dict(sliding_window=None), r"config\.sliding_window: null is not supported with sliding_attention layers"),
    (dict(layer_types=["full_attention", "chunked_attention", "full_attention", "full_attention"]),
     r"config\.layer_types: expected 4 entries of full_attention, sliding_attention"),
    (dict(gating="per-element"), r"config\.gating: 'per-element' is not supported; true or \"per-head\""),
    (dict(use_bidirectional_attention=True), r"config\.use_bidirectional_attention: true is not supported"),
    (dict(mlp_bias=True), r"config\.mlp_bias: true is not supported"),
    (dict(use_head_wise_attn_gate=False),
     r"config\.use_head_wise_attn_gate: False is not supported; Step-3\.5 runs True"),
    (dict(moe_router_activation="softmax"), r"config\.moe_router_activation: 'softmax' is not supported"),
    (dict(yarn_only_types=["sliding_attention"]),
     r"config\.yarn_only_types: \['sliding_attention'\] is not supported"),
    (dict(swiglu_limits=[1.0, 2.0]), r"config\.swiglu_limits: expected 4 entries"),
    (dict(mlp_layer_types=DROP, moe_layers_enum="1,x"), r"config\.moe_layers_enum: expected layer numbers"),
    (dict(per_layer_config={"0": {"num_attention_heads": 2}}), r"config\.per_layer_config\.0: .* is not supported"),
    (dict(num_experts_per_tok=9), r"config\.num_experts_per_tok: 9 exceeds the number of routed experts \(8\)"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}),
     r"config\.rope_parameters\.full_attention: partial_rotary_factor 0\.1 of head_dim=8 rotates 0 features"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpts, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpts[0], tmp_path / "bad", **overrides), ConfigError, match)


def test_the_wrappers_refusals_name_the_field_inside_text_config(ckpts, tmp_path):
    cfg = json.loads((ckpts[1] / "config.json").read_text())
    bad = with_config(ckpts[1], tmp_path / "bad", text_config=dict(cfg["text_config"], gating="per-group"))
    check_refused_before_any_plan(bad, ConfigError, r"config\.text_config\.gating: 'per-group' is not supported")
