"""GLM-4.5V (`Glm4vMoeForConditionalGeneration`) run text-only: GLM-4-MoE's text model from the wrapper's
text_config and `model.language_model.` tensors, its vision tower skipped; logits and greedy tokens against
transformers' whole multimodal model fed text alone (its MRoPE then the plain rotary embedding), fused and
unfused; planned by GLM-4-MoE's gate asked with text_config; a q/k norm it does not have refused by field."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.engine.generate import generate
from loadplan.plan import Keys

from engine_helpers import (check_refused_before_any_plan, hf_greedy, hf_logits_of_order_one, load_local, logits_of,
                            make_glm4v_moe_checkpoint, prompt, with_config)

ARCH = "Glm4vMoeForConditionalGeneration"
TOL = 1e-4
N_NEW = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_glm4v_moe_checkpoint(tmp_path_factory.mktemp("glm4v_moe"))


def test_text_only_logits_and_greedy_tokens_match_transformers_fused_and_unfused(ckpt):
    ids = prompt(T=11)
    want = hf_logits_of_order_one(ckpt, ARCH, ids)
    tokens = hf_greedy(ckpt, ARCH, ids[0].tolist(), N_NEW)
    for fused in (True, False):
        model = load_local(ckpt, disable_shared_experts_fusion=not fused)
        d = model.plan.decisions
        assert d[Keys.ENTRY_FAMILY].value == "glm4_moe" and d[Keys.SHARED_EXPERTS_FUSION].value is fused
        assert (logits_of(model, ids) - want).abs().max().item() <= TOL
        assert generate(model, ids[0], N_NEW)[0].tolist() == tokens
    attn = model.language_model.model.layers[0].self_attn
    assert attn.q_norm is None and attn.rotary_dim == 8 and attn.q_proj.bias is not None and attn.o_proj.bias is None


def test_a_qk_norm_it_does_not_have_is_refused_by_field_before_any_plan(ckpt, tmp_path):
    import json

    text = json.loads((ckpt / "config.json").read_text())["text_config"]
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "qk", text_config=dict(text, use_qk_norm=True)),
                                  ConfigError, r"config\.text_config\.use_qk_norm: true not supported")
