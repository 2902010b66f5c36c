"""Granite MoE (`GraniteMoeForCausalLM`: Mixtral's layer with embedding, attention, residual and logit multipliers)
from save_pretrained checkpoints: logits and greedy tokens against transformers, float32, with granite-3.0's
multipliers and with attention biases; its stacked experts read as the model holds them even where 2I == D (the
shapes cannot tell the orientation); the registry plans it with no shared experts; what it cannot run is refused
by field; GraniteMoeShared's ungated shared MLP, never fused. EP 2 with every backend: tests/engine/parallel/
test_expert_parallel.py; TP 2: test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (GRANITEMOE_SWA_TINY, check_matches_transformers, check_refused_before_any_plan,
                            make_granitemoe_checkpoint, prompt, with_config)

ARCH = "GraniteMoeForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_granitemoe_checkpoint(tmp_path_factory.mktemp("granitemoe"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=11)


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "granitemoe" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert model.model.layers[0].self_attn.scale == 0.015625 and model.model.layers[0].residual_multiplier == 0.22
    # gate_up [8, 2 x 16, 32]: as wide as it is tall, read as the model holds it
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 32, 32)


@pytest.mark.parametrize("config", [
    dict(attention_bias=True, tie_word_embeddings=True, num_experts_per_tok=3),
    dict(intermediate_size=24, embedding_multiplier=1.0, residual_multiplier=1.0),   # 2I != D; no multipliers
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_granitemoe_checkpoint(tmp_path / "v", **config), ARCH, ids)


def test_a_stacked_matrix_not_as_the_model_holds_it_is_refused_naming_it(tmp_path):
    """Granite's checkpoints keep the experts as the model holds them; one transposed for x @ W is not guessed, and the
    refusal names the tensor as the checkpoint spells it."""
    from safetensors.torch import load_file, save_file

    from loadplan.engine.weights import ShapeMismatch

    from engine_helpers import load_local

    path = make_granitemoe_checkpoint(tmp_path / "ok", intermediate_size=24)        # 2I = 48, D = 32
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.input_linear.weight"
    tensors[name] = tensors[name].transpose(1, 2).contiguous()                    # [8, 32, 48]
    bad = tmp_path / "transposed"
    bad.mkdir()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ShapeMismatch, match=r"'model\.layers\.1\.block_sparse_moe\.input_linear\.weight' has shape "
                                            r"\[8, 32, 48\]: expected \[E, 48, 32\]"):
        load_local(bad)


def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "zero", logits_scaling=0), ConfigError,
                                  r"config\.logits_scaling: must not be 0")


def test_the_shared_variant_matches_transformers_and_its_shared_mlp_is_never_fused(tmp_path, ids):
    """GraniteMoeShared: the shared MLP's [2S, D] gate-and-up matrix read as its two halves, added ungated."""
    path = make_granitemoe_checkpoint(tmp_path / "shared", family="GraniteMoeShared", shared_intermediate_size=24)
    model = check_matches_transformers(path, "GraniteMoeSharedForCausalLM", ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "granitemoe_shared" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "granitemoe_shared.structural.no_fused_layout"
    assert model.model.layers[0].mlp.shared_mlp.gate_proj.out_features == 24


def test_the_swa_variant_matches_transformers_with_its_sinks_windows_and_thetas(tmp_path, ids):
    """Granite MoE SWA (granite-swash): a sink logit per head on every layer, layers 1 and 2 windowed, each layer its
    own rope theta (layer 2 none), a shared MLP never fused; its checkpoints name the experts as transformers 5 does."""
    path = make_granitemoe_checkpoint(tmp_path / "swa", family="GraniteMoeSWA", **GRANITEMOE_SWA_TINY)
    model = check_matches_transformers(path, "GraniteMoeSWAForCausalLM", ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "granitemoe_swa" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    attn = [layer.self_attn for layer in model.model.layers]
    assert [(a.sliding_window, a.use_rope, a.sinks is not None) for a in attn] == \
        [(None, True, True), (4, True, True), (4, False, True)]
    assert [layer.rotary.rope.theta if layer.rotary else None for layer in model.model.layers] == [1e4, 500.0, None]


@pytest.mark.parametrize("overrides,match", [
    (dict(layer_rope_theta=[1e4, -1, 0]), r"config\.layer_rope_theta: expected 3 numbers >= 0"),
    (dict(layer_types=["full_attention"] * 2), r"config\.layer_types: expected 3 entries"),
    (dict(sliding_window=0), r"config\.sliding_window: must be >= 1"),
])
def test_what_the_swa_variant_cannot_run_is_refused_by_field_before_any_plan(tmp_path, overrides, match):
    path = make_granitemoe_checkpoint(tmp_path / "swa", family="GraniteMoeSWA", **GRANITEMOE_SWA_TINY)
    check_refused_before_any_plan(with_config(path, tmp_path / "bad", **overrides), ConfigError, match)
