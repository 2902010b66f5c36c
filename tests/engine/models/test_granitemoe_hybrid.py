"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens (decoded
through the Mamba2 layers' state cache and the attention layers' KV cache) against transformers, float32: Mamba2 and
NoPE attention layers over Granite MoE's experts and shared MLP; rotary attention, one Mamba2 group, conv and
projection biases, a tied head, the Hub's layer-kind spellings; a prompt longer than a chunk; a batch decodes each
row as alone; speculative decoding with a Granite 4.0-H target rolls its Mamba2 layers back; the registry plans it
with its shared MLP unfused; what it cannot run is refused by field before any plan. EP 2 with every backend, TP 2
and PP 2: tests/engine/parallel/."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.layers.attention import GQAttention
from loadplan.engine.layers.mamba2 import Mamba2Mixer
from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_batch_rows_decode_alone, check_decoding_token_by_token, check_matches_transformers,
                            check_refused_before_any_plan, check_speculative_target_rolls_back, load_local, logits_of,
                            make_granitemoe_hybrid_checkpoint, prompt, with_config)

ARCH = "GraniteMoeHybridForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_granitemoe_hybrid_checkpoint(tmp_path_factory.mktemp("granitemoe_hybrid"))





def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "granitemoe_hybrid" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert [type(layer.mixer) for layer in model.model.layers] == [Mamba2Mixer, GQAttention, Mamba2Mixer]
    assert model.moe_layer_ids == (0, 1, 2) and not model.model.layers[1].self_attn.use_rope
    assert all(layer.mlp.shared_mlp is not None for layer in model.model.layers)


@pytest.mark.parametrize("config", [
    dict(position_embedding_type="rope", attention_multiplier=1.0),
    dict(mamba_n_groups=1, mamba_conv_bias=False, mamba_proj_bias=True, tie_word_embeddings=True),
    dict(layer_types=["attention", "mamba", "mamba"], mamba_d_conv=2, mamba_n_heads=8),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_granitemoe_hybrid_checkpoint(tmp_path / "v", **config), ARCH, ids)


def test_the_hubs_spellings_of_its_config_are_read_alike(ckpt, tmp_path, ids):
    """Its published config.json says "mamba" / "attention" and "nope" (transformers 5 writes other names)."""
    hub = with_config(ckpt, tmp_path / "hub", layer_types=["mamba", "attention", "mamba"],
                      position_embedding_type="nope", time_step_limit=[0.0, float("inf")])
    torch.testing.assert_close(logits_of(load_local(hub), ids), logits_of(load_local(ckpt), ids))


def test_a_prompt_longer_than_a_chunk_matches_transformers(ckpt):
    """150 tokens: the engine's scan runs three chunks of 64, transformers' 38 chunks of 4."""
    check_matches_transformers(ckpt, ARCH, prompt(B=1, T=150, seed=3), n_new=3)


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


def test_speculative_decoding_with_a_granite_hybrid_target_gives_its_greedy_tokens(tmp_path):
    """Its Mamba2 layers continue from the state of the last accepted position."""
    check_speculative_target_rolls_back(make_granitemoe_hybrid_checkpoint(tmp_path / "target"), tmp_path / "draft",
                                        0.05)


@pytest.mark.parametrize("overrides,match", [
    (dict(num_local_experts=0), r"config\.num_local_experts: must be >= 1"),
    (dict(layer_types=["mamba", "sliding_attention", "mamba"]), r"config\.layer_types: expected 3 entries"),
    (dict(position_embedding_type="alibi"), r"config\.position_embedding_type: 'alibi' not supported"),
    (dict(mamba_d_head=8), r"config\.mamba_d_head: 8 x mamba_n_heads=4 must be"),
    (dict(mamba_n_heads=4, mamba_n_groups=3), r"config\.mamba_n_groups: 3 must be >= 1 and divide"),
    (dict(mamba_n_heads=5), r"config\.mamba_n_heads: 5 must be >= 1 and divide"),
    (dict(time_step_limit=[1.0, 0.0]), r"config\.time_step_limit: expected \[low, high\]"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
