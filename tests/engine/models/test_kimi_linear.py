"""Kimi-Linear (`KimiLinearForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens (decoded through
the Kimi delta attention layers' state cache and the latent KV cache) against transformers, float32: KDA layers (a
decay per channel, separate q/k/v convs, the sigmoid-gated output norm) and a NoPE MLA layer, DeepSeek-V3's MoE with
a shared expert beside it and a dense first layer; with a query latent and a tied head; the layer kinds as its Hub
config writes them (linear_attn_config, counted from 1), as transformers derives them by default, and the dense
layers from first_k_dense_replace; a prompt of several chunks; token-by-token decoding; a batch decodes each row as
alone; speculative decoding rolls its KDA layers back; the registry plans it unfused; what it cannot run is refused
by field before any plan. EP 2 with every backend, TP 2 and PP 2: tests/engine/parallel/."""

from __future__ import annotations

import json

import pytest
import torch

from loadplan.engine.layers.kimi_delta_attention import KimiDeltaAttention
from loadplan.engine.layers.mla import MultiHeadLatentAttention
from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (DROP, check_batch_rows_decode_alone, check_decoding_token_by_token, check_matches_transformers,
                            check_refused_before_any_plan, check_speculative_target_rolls_back, hf_logits_of_order_one,
                            load_local, logits_of, make_kimi_linear_checkpoint, prompt, with_config)

ARCH = "KimiLinearForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_kimi_linear_checkpoint(tmp_path_factory.mktemp("kimi_linear"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "kimi_linear" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert [type(layer.mixer) for layer in model.model.layers] == [KimiDeltaAttention, MultiHeadLatentAttention,
                                                                     KimiDeltaAttention, KimiDeltaAttention]
    assert not model.model.layers[1].self_attn.use_rope
    assert model.moe_layer_ids == (1, 2, 3) and model.model.layers[1].mlp.shared_experts is not None


def test_with_a_query_latent_it_matches_transformers_and_never_ties_its_head(tmp_path, ids):
    """transformers' Kimi-Linear keeps its own lm_head whatever tie_word_embeddings says, and so does the engine."""
    model = check_matches_transformers(make_kimi_linear_checkpoint(tmp_path / "v", seed=2, q_lora_rank=16,
                                                                   tie_word_embeddings=True), ARCH, ids)
    assert model.lm_head is not None and model.model.layers[1].self_attn.q_lora_rank == 16


def test_the_hub_spelling_of_its_layers_is_read_as_transformers_reads_it(ckpt, tmp_path, ids):
    """The KDA sizes and the layers' kinds under linear_attn_config, the kinds counted from 1."""
    path = with_config(ckpt, tmp_path / "hub", layer_types=DROP, linear_head_dim=DROP, linear_num_heads=DROP,
                       linear_conv_kernel_dim=DROP, linear_attn_config={
                           "kda_layers": [1, 3, 4], "full_attn_layers": [2], "head_dim": 8, "num_heads": 4,
                           "short_conv_kernel_size": 4})
    model = check_matches_transformers(path, ARCH, ids)
    assert type(model.model.layers[1].mixer) is MultiHeadLatentAttention
    assert json.loads((ckpt / "config.json").read_text())["num_experts"] == 8   # transformers' own spelling


def test_without_layer_kinds_it_runs_transformers_defaults(tmp_path, ids):
    """Every 4th layer but the first is MLA (layer 4 of 5), the dense layers from first_k_dense_replace."""
    made = make_kimi_linear_checkpoint(tmp_path / "five", num_hidden_layers=5, layer_types=None, mlp_layer_types=None,
                                       first_k_dense_replace=2)
    path = with_config(made, tmp_path / "defaults", layer_types=DROP, mlp_layer_types=DROP, first_k_dense_replace=2)
    model = check_matches_transformers(path, ARCH, ids)
    assert [type(layer.mixer) for layer in model.model.layers] == [KimiDeltaAttention] * 4 + [MultiHeadLatentAttention]
    assert model.moe_layer_ids == (2, 3, 4)


def test_a_prompt_of_several_chunks_matches_transformers(ckpt):
    ids = prompt(B=1, T=150, seed=3)
    got = logits_of(load_local(ckpt), ids)
    assert (got - hf_logits_of_order_one(ckpt, ARCH, ids)).abs().max() <= 1e-4


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


def test_speculative_decoding_with_a_kimi_linear_target_gives_its_greedy_tokens(ckpt, tmp_path):
    check_speculative_target_rolls_back(ckpt, tmp_path / "draft", 0.06)


@pytest.mark.parametrize("overrides,match", [
    (dict(mla_use_nope=False), r"config\.mla_use_nope: False not supported; Kimi-Linear runs True"),
    (dict(linear_attn_config={"gate_lower_bound": -5.0}),
     r"config\.linear_attn_config\.gate_lower_bound: -5\.0 not supported"),
    (dict(hidden_act="gelu"), r"config\.hidden_act: 'gelu' not supported; supported: 'silu'"),
    (dict(moe_layer_freq=2), r"config\.moe_layer_freq: 2 not supported; Kimi-Linear runs 1"),
    (dict(layer_types=None, linear_attn_config={"kda_layers": [1, 2], "full_attn_layers": [3]}),
     r"config\.linear_attn_config\.kda_layers: with full_attn_layers, must number each of the 4 layers once"),
    (dict(num_experts_per_token=9), r"config\.num_experts_per_token: 9 exceeds the number of routed experts \(8\)"),
    (dict(num_expert_group=3), r"config\.num_expert_group/topk_group: 3/1 do not split 8 experts into groups"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)


def test_the_dt_bias_stays_float32_in_a_bfloat16_model(ckpt):
    """As transformers keeps it (its decays are softplus(x + dt_bias): bfloat16 would round them)."""
    model = load_local(ckpt, dtype=torch.bfloat16)
    kda = model.model.layers[0].self_attn
    assert kda.dt_bias.dtype == torch.float32 and kda.q_proj.weight.dtype == torch.bfloat16
