"""Phi-3.5-MoE (`PhiMoEForCausalLM` on the Hub, `PhimoeForCausalLM` as transformers saves it) from save_pretrained
checkpoints: logits and greedy tokens against transformers, float32, with its LayerNorms, biases (attention and
head), sparsemixer router (a wide margin too, where several experts share the softmax) and LongRoPE; the plain rope,
tied embeddings, a sliding window; its config.json as the Hub writes it; positions past the original context refused
(the long factors are not supported); the registry plans it with no shared experts; what it cannot run is refused by
field before any plan. EP 2 with every backend: tests/engine/parallel/test_expert_parallel.py; TP 2:
test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (PHIMOE_TINY, check_matches_transformers, check_refused_before_any_plan, load_local,
                            make_phimoe_checkpoint, with_config)

ARCH = "PhimoeForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_phimoe_checkpoint(tmp_path_factory.mktemp("phimoe"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "phimoe" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert model.rotary.rope.rope_type == "longrope" and model.rotary.attention_factor == 1.2
    assert model.lm_head.bias is not None and model.model.norm.bias is not None


@pytest.mark.parametrize("config", [
    dict(router_jitter_noise=0.5),                       # a wide margin: several logits share each softmax
    dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False, lm_head_bias=False,
         tie_word_embeddings=True),
    dict(sliding_window=4),                              # shorter than the prompt: the window masks
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_phimoe_checkpoint(tmp_path / "v", **config), ARCH, ids)


def test_the_hubs_config_json_is_read_as_transformers_reads_it(ckpt, tmp_path, ids):
    """microsoft/Phi-3.5-MoE-instruct's config.json: its own spelling of the entry class, LongRoPE under rope_scaling
    ("type"), the original context at the top level, a sliding window as long as the context."""
    rope = dict(PHIMOE_TINY["rope_parameters"])
    del rope["rope_type"], rope["rope_theta"]
    hub = with_config(ckpt, tmp_path / "hub", architectures=["PhiMoEForCausalLM"], rope_parameters=None,
                      rope_theta=10000.0, rope_scaling=dict(rope, type="longrope"),
                      original_max_position_embeddings=64, sliding_window=256)
    model = check_matches_transformers(hub, ARCH, ids)
    assert model.plan.request.config["architectures"] == ["PhiMoEForCausalLM"]
    assert model.plan.decisions[Keys.ENTRY_FAMILY].value == "phimoe"


def test_positions_past_the_original_context_are_refused(ckpt):
    model = load_local(ckpt)
    with torch.no_grad():
        model(torch.zeros(1, 64, dtype=torch.long))                      # positions 0..63: the short factors
        with pytest.raises(ValueError, match=r"position 64 is beyond original_max_position_embeddings=64"):
            model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("overrides,match", [
    (dict(num_experts_per_tok=3), r"config\.num_experts_per_tok: 3 is not supported; .* exactly 2 experts"),
    (dict(tie_word_embeddings=True), r"config\.lm_head_bias: a head bias with tie_word_embeddings"),
    (dict(router_jitter_noise=-0.1), r"config\.router_jitter_noise: must be >= 0"),
    (dict(rope_parameters=dict(PHIMOE_TINY["rope_parameters"], short_factor=[1.0, 1.0, 1.0],
                               long_factor=[1.0, 1.0, 1.0])),
     r"config\.rope_parameters: 3 short factors; the rotary dimension 8 needs one per pair"),
    (dict(rope_parameters=dict(PHIMOE_TINY["rope_parameters"], short_mscale=None)),
     r"config\.rope_parameters: longrope short_mscale must be a number"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
