"""LongCat-Flash (`LongcatFlashForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens against
transformers, float32: layers of two MLA sublayers (both latents scaled) and two dense MLPs, one MoE block a layer
fed by the first sublayer and added at the layer's end, whose router picks among routed experts and
zero-computation ones (the input returned, weighted); YaRN, no zero-computation experts; token-by-token decoding through both sublayers' caches; a batch decodes each row as alone; speculative
decoding; the registry plans it with no shared expert; the unused rows transformers saves for the zero-computation
experts are left out, any other expert beyond them refused; what it cannot run is refused by field before any plan.
EP 2 with every backend, TP 2 and PP 2: tests/engine/parallel/."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.models.config import ConfigError
from loadplan.engine.models.longcat_flash import LongcatFlashMoE
from loadplan.engine.weights import WeightError
from loadplan.plan import Keys

from engine_helpers import (DROP, check_batch_rows_decode_alone, check_decoding_token_by_token,
                            check_matches_transformers, check_refused_before_any_plan,
                            check_speculative_target_rolls_back, load_local, make_longcat_flash_checkpoint,
                            with_config, with_tensors)

ARCH = "LongcatFlashForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_longcat_flash_checkpoint(tmp_path_factory.mktemp("longcat"))


def test_logits_and_greedy_tokens_match_transformers_with_zero_computation_experts_picked(ckpt, ids):
    picks = []
    model = load_local(ckpt)
    model.model.layers[0].mlp.router.register_forward_hook(lambda mod, inp, out: picks.append(out[0]))
    check_matches_transformers(ckpt, ARCH, ids)
    with torch.no_grad():
        model(ids)
    assert (picks[0] >= 8).any() and (picks[0] < 8).any()        # both kinds of expert chosen for these tokens
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "longcat_flash" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert model.moe_layer_ids == (0, 1) and isinstance(model.model.layers[1].mlp, LongcatFlashMoE)
    assert model.routed_experts_weights_of_layer[0][0].shape[0] == 8        # the routed experts only


@pytest.mark.parametrize("config", [
    dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}),
    dict(zero_expert_num=0, moe_topk=2, tie_word_embeddings=True),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_longcat_flash_checkpoint(tmp_path / "v", seed=2, **config), ARCH, ids)


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


def test_speculative_decoding_with_a_longcat_flash_target_gives_its_greedy_tokens(ckpt, tmp_path):
    check_speculative_target_rolls_back(ckpt, tmp_path / "draft", 0.06)


def test_an_expert_beyond_the_zero_computation_ones_is_refused_by_name(ckpt, tmp_path):
    def extra(tensors):
        tensors["model.layers.0.mlp.experts.12.gate_proj.weight"] = torch.zeros(16, 32)
    with pytest.raises(WeightError, match=r"model\.layers\.0\.mlp\.experts\.12\.gate_proj\.weight"):
        load_local(with_tensors(ckpt, tmp_path / "extra", extra))


@pytest.mark.parametrize("overrides,match", [
    (dict(router_bias=True), r"config\.router_bias: true not supported"),
    (dict(head_dim=16), r"config\.head_dim: 16 must equal qk_rope_head_dim=8"),
    (dict(qk_head_dim=20), r"config\.qk_head_dim: 20 must be qk_nope_head_dim \+ qk_rope_head_dim = 16"),
    (dict(moe_topk=13), r"config\.moe_topk: 13 exceeds the number of experts \(8 routed and 4 zero-computation ones\)"),
    # transformers reads num_hidden_layers alone as the count of sublayers, SGLang as the count of layers
    (dict(num_layers=DROP, num_hidden_layers=4), r"config\.num_layers: missing: num_hidden_layers alone counts"),
    (dict(rope_interleave=False), r"config\.rope_interleave: False not supported"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
