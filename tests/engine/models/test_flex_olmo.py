"""FlexOlmo (`FlexOlmoForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens against transformers,
float32, in OLMo 2's post-norm layer (no input norm; each block's output normalised), with OLMoE's projection-wide
q/k norms, also with heads narrower than hidden_size / heads, renormalised top-k and attention biases; the registry
plans it with no shared experts; clip_qkv refused by field before any plan. EP 2 with every backend: tests/engine/
parallel/test_expert_parallel.py; TP 2: test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from loadplan.engine.layers.norm import WeightFirstRMSNorm
from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_matches_transformers, check_refused_before_any_plan, make_flex_olmo_checkpoint,
                            with_config)

ARCH = "FlexOlmoForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_flex_olmo_checkpoint(tmp_path_factory.mktemp("flex_olmo"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "flex_olmo" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    layer = model.model.layers[0]
    assert not hasattr(layer, "input_layernorm") and isinstance(layer.post_feedforward_layernorm, WeightFirstRMSNorm)
    assert isinstance(layer.self_attn.q_proj_norm, WeightFirstRMSNorm)


@pytest.mark.parametrize("config", [
    dict(head_dim=6, norm_topk_prob=True, attention_bias=True),      # q norm over 4 x 6 = 24 features, not 32
    dict(tie_word_embeddings=True, num_experts_per_tok=3),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_flex_olmo_checkpoint(tmp_path / "v", **config), ARCH, ids)


def test_clip_qkv_is_refused_by_field_before_any_plan(ckpt, tmp_path):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "clip", clip_qkv=8.0), ConfigError,
                                  r"config\.clip_qkv: 8\.0 is not supported")
