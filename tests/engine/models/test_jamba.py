"""Jamba (`JambaForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens (decoded through the Mamba
layers' state cache and the attention layers' KV cache) against transformers, float32: Mamba layers (dt, B and C
RMS-normalised) and a NoPE attention layer, Mixtral's experts with unrenormalised top-k weights on every other layer
and dense MLPs between; projection biases, no conv bias, a tied head, other periods and dt rank; token-by-token
decoding; a batch decodes each row as alone; speculative decoding rolls its Mamba layers back; the registry plans it
with no shared experts; what it cannot run is refused by field before any plan. EP 2 with every backend, TP 2 and
PP 2: tests/engine/parallel/."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.layers.attention import GQAttention
from loadplan.engine.layers.mamba1 import Mamba1Mixer, selective_scan
from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_batch_rows_decode_alone, check_decoding_token_by_token, check_matches_transformers,
                            check_refused_before_any_plan, check_speculative_target_rolls_back, make_jamba_checkpoint,
                            with_config)

ARCH = "JambaForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_jamba_checkpoint(tmp_path_factory.mktemp("jamba"))





def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "jamba" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert [type(layer.mixer) for layer in model.model.layers] == [Mamba1Mixer, Mamba1Mixer, GQAttention,
                                                                     Mamba1Mixer]
    assert model.moe_layer_ids == (1, 3) and not model.model.layers[2].self_attn.use_rope
    assert not model.model.layers[1].mlp.norm_topk_prob


@pytest.mark.parametrize("config", [
    dict(mamba_conv_bias=False, mamba_proj_bias=True, tie_word_embeddings=True, mamba_dt_rank=3),
    dict(num_hidden_layers=5, attn_layer_period=2, attn_layer_offset=0, expert_layer_period=3,
         expert_layer_offset=2, mamba_d_conv=2, mamba_expand=1),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_jamba_checkpoint(tmp_path / "v", **config), ARCH, ids)


def test_the_scan_is_decay_then_write_then_read_per_channel_and_state_feature():
    """One step by hand: S1 = exp(dt A) S0 + dt b x, y = S1 c, each channel its own decays."""
    g = torch.Generator().manual_seed(0)
    x, dt = torch.randn(1, 1, 3, generator=g), torch.rand(1, 1, 3, generator=g)
    A, b, c = -torch.rand(3, 2, generator=g), torch.randn(1, 1, 2, generator=g), torch.randn(1, 1, 2, generator=g)
    s0 = torch.randn(1, 3, 2, generator=g)
    y, states = selective_scan(x, dt, A, b, c, s0)
    s1 = torch.exp(dt[0, 0, :, None] * A) * s0[0] + (dt[0, 0] * x[0, 0])[:, None] * b[0, 0][None, :]
    torch.testing.assert_close(states[0, 0], s1)
    torch.testing.assert_close(y[0, 0], s1 @ c[0, 0])


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


def test_speculative_decoding_with_a_jamba_target_gives_its_greedy_tokens(tmp_path):
    check_speculative_target_rolls_back(make_jamba_checkpoint(tmp_path / "target"), tmp_path / "draft", 0.3)


@pytest.mark.parametrize("overrides,match", [
    (dict(num_experts=1), r"config\.num_experts: must be >= 2, got 1"),
    (dict(attn_layer_offset=4), r"config\.attn_layer_offset: must be in \[0, attn_layer_period=4\), got 4"),
    (dict(expert_layer_period=0), r"config\.expert_layer_period: must be >= 1, got 0"),
    (dict(mamba_d_state=0), r"config\.mamba_d_state: must be >= 1, got 0"),
    (dict(mamba_dt_rank=0), r"config\.mamba_dt_rank: must be >= 1"),
    (dict(num_experts_per_tok=9), r"config\.num_experts_per_tok: 9 exceeds the number of routed experts \(8\)"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
