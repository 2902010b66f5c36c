"""The Ling 3 hybrids (`BailingHybridForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens against
transformers, float32: Kimi delta attention in its Ling form (full-rank gates, float32 convolutions, the bounded
decay or the softplus one) and MLA with a sigmoid gate per head and interleaved rope, DeepSeek-V3's MoE with a shared
expert beside it and a dense first layer; with a query latent; the layers' kinds from layer_group_size and
first_k_dense_replace as transformers derives them; a prompt of several chunks; token-by-token decoding; a batch
decodes each row as alone; speculative decoding rolls its KDA layers back; the checkpoint's MTP layers skipped; the
registry plans it unfused; what it cannot run is refused by field before any plan. EP 2 with every backend and TP 2:
tests/engine/parallel/."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.layers.kimi_delta_attention import KimiDeltaAttention
from loadplan.engine.layers.mla import MultiHeadLatentAttention
from loadplan.engine.models.config import ConfigError
from loadplan.engine.weights import WeightError
from loadplan.plan import Keys

from engine_helpers import (DROP, check_batch_rows_decode_alone, check_decoding_token_by_token,
                            check_matches_transformers, check_refused_before_any_plan,
                            check_speculative_target_rolls_back, hf_logits_of_order_one, load_local, logits_of,
                            make_bailing_hybrid_checkpoint, prompt, with_config, with_tensors)

ARCH = "BailingHybridForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_bailing_hybrid_checkpoint(tmp_path_factory.mktemp("bailing_hybrid"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "bailing_hybrid" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    kinds = [type(layer.mixer) for layer in model.model.layers]
    assert kinds == [KimiDeltaAttention, KimiDeltaAttention, MultiHeadLatentAttention]
    assert model.model.layers[0].self_attn.lower_bound == -5.0 and model.model.layers[2].self_attn.g_proj is not None
    assert model.moe_layer_ids == (1, 2) and model.lm_head is not None


@pytest.mark.parametrize("config", [dict(kda_safe_gate=False), dict(q_lora_rank=16, kda_lower_bound=-3.0)])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_bailing_hybrid_checkpoint(tmp_path / "v", seed=2, **config), ARCH, ids)


def test_without_layer_kinds_it_runs_transformers_defaults(ckpt, tmp_path, ids):
    """The last layer of each layer_group_size is MLA, the dense layers from first_k_dense_replace."""
    check_matches_transformers(with_config(ckpt, tmp_path / "defaults", layer_types=DROP, mlp_layer_types=DROP), ARCH,
                               ids)


def test_a_prompt_of_several_chunks_matches_transformers(ckpt):
    ids = prompt(B=1, T=150, seed=3)
    assert (logits_of(load_local(ckpt), ids) - hf_logits_of_order_one(ckpt, ARCH, ids)).abs().max() <= 1e-4


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


def test_speculative_decoding_with_a_ling_target_gives_its_greedy_tokens(ckpt, tmp_path):
    check_speculative_target_rolls_back(ckpt, tmp_path / "draft", 0.06)


def test_the_mtp_layers_it_stores_after_the_last_layer_are_skipped_and_no_others(ckpt, tmp_path, ids):
    def mtp(tensors):
        tensors["model.layers.3.attention.dense.weight"] = torch.zeros(32, 48)
    with_mtp = with_tensors(ckpt, tmp_path / "mtp", mtp)
    with pytest.raises(WeightError, match=r"model\.layers\.3\.attention\.dense\.weight"):
        load_local(with_mtp)                                          # no MTP layer: a layer too many
    for field in ("num_nextn_predict_layers", "num_mtp_layers"):       # transformers' name, and its alias
        one = with_config(with_mtp, tmp_path / field, **{"num_nextn_predict_layers": DROP, field: 1})
        assert torch.equal(logits_of(load_local(one), ids), logits_of(load_local(ckpt), ids))


@pytest.mark.parametrize("overrides,match", [
    (dict(rope_interleave=False), r"config\.rope_interleave: False not supported"),
    (dict(moe_layer_freq=2), r"config\.moe_layer_freq: 2 not supported"),
    (dict(hidden_act="gelu"), r"config\.hidden_act: 'gelu' not supported; supported: 'silu'"),
    (dict(num_experts_per_token=9), r"config\.num_experts_per_token: 9 exceeds the number of routed experts \(8\)"),
    (dict(layer_types=DROP, layer_group_size=0), r"config\.layer_group_size: must be >= 1, got 0"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
