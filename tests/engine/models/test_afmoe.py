"""AFMoE (`AfmoeForCausalLM`: Arcee's Trinity) from save_pretrained checkpoints: logits and greedy tokens against
transformers, float32: gated attention (its own gate_proj), windowed layers rotated beside global NoPE ones, sandwich
norms, a sigmoid router with its routing bias (`mlp.expert_bias`) and route_scale, shared experts; muP's embedding
scale, attention biases, explicit layer_types; the registry plans its shared experts, never fused; what it cannot run
is refused by field before any plan. EP 2 with every backend: tests/engine/parallel/test_expert_parallel.py; TP 2:
test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_matches_transformers, check_refused_before_any_plan, make_afmoe_checkpoint,
                            with_config)

ARCH = "AfmoeForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_afmoe_checkpoint(tmp_path_factory.mktemp("afmoe"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "afmoe" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "afmoe.structural.no_fused_layout"
    attn = [layer.self_attn for layer in model.model.layers]
    # global_attn_every_n_layers 2: layers 0 and 2 windowed (and rotated), 1 and 3 global without rotation
    assert [(a.sliding_window, a.use_rope) for a in attn] == [(4, True), (None, False)] * 2
    assert all(a.gate_proj is not None for a in attn) and model.moe_layer_ids == (1, 2, 3)
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0


@pytest.mark.parametrize("config", [
    dict(mup_enabled=True, attention_bias=True, route_scale=1.0, num_shared_experts=1),
    dict(layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"], sliding_window=3,
         num_dense_layers=0, tie_word_embeddings=True),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_afmoe_checkpoint(tmp_path / "v", **config), ARCH, ids)


@pytest.mark.parametrize("overrides,match", [
    (dict(n_group=2), r"config\.n_group: 2 not supported"),
    (dict(global_attn_every_n_layers=0, layer_types=None), r"config\.global_attn_every_n_layers: must be >= 1"),
    (dict(sliding_window=None), r"config\.sliding_window: null, but layer_types has sliding_attention layers"),
    (dict(layer_types=["full_attention"] * 3), r"config\.layer_types: expected 4 entries"),
    (dict(partial_rotary_factor=0.5), r"config\.partial_rotary_factor: 0\.5 not supported"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
