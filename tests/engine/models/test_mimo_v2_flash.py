"""MiMo-V2-Flash (`MiMoV2FlashForCausalLM`) from save_pretrained checkpoints: logits and greedy tokens against
transformers, float32: a global layer and windowed ones (twice the key/value heads, sink logits stored as
`attention_sink_bias`), values narrower than keys and scaled, each layer kind its own rotary tables (theta, rotated
fraction), DeepSeek-V3's grouped sigmoid router without shared experts; the Hub's `sliding_window_size` and null
routed_scaling_factor; its released checkpoints' MTP layers skipped; the registry plans it with no shared experts;
what it cannot run is refused by field before any plan. EP 2 with every backend:
tests/engine/parallel/test_expert_parallel.py; TP 2: test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_matches_transformers, check_refused_before_any_plan, load_local, logits_of,
                            make_mimo_v2_flash_checkpoint, with_config, with_tensors)

ARCH = "MiMoV2FlashForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_mimo_v2_flash_checkpoint(tmp_path_factory.mktemp("mimo_v2_flash"))


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "mimo_v2_flash" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    layers = model.model.layers
    assert [(layer.self_attn.n_kv_heads, layer.self_attn.sliding_window, layer.self_attn.sinks is not None)
            for layer in layers] == [(1, None, False), (2, 4, True), (2, 4, True)]
    assert [layer.self_attn.rotary_dim for layer in layers] == [6, 4, 4]        # 12 x 0.5, int(12 x 0.334)
    assert layers[0].self_attn.v_head_dim == 8 and layers[0].self_attn.v_scale == pytest.approx(0.707)
    assert model.moe_layer_ids == (1, 2) and layers[1].mlp.shared_experts is None


def test_the_hubs_spellings_are_read_as_transformers_reads_them(ckpt, tmp_path, ids):
    """sliding_window_size: the tokens before the query (the window is one more, whatever sliding_window says);
    routed_scaling_factor null: 1."""
    hub = with_config(ckpt, tmp_path / "hub", sliding_window=99, sliding_window_size=2, routed_scaling_factor=None,
                      attention_value_scale=0.5)
    model = check_matches_transformers(hub, ARCH, ids)
    assert model.model.layers[1].self_attn.sliding_window == 3


def test_n_shared_experts_and_moe_layer_freq_are_not_read_as_transformers_reads_neither(ckpt, tmp_path, ids):
    """MiMo-V2-Flash's MoE has no shared expert: n_shared_experts and moe_layer_freq are not read (by transformers
    or the registry's mimo_v2_flash_layout; SGLang places the MoE layers by the Hub's moe_layer_freq flags: the sglang
    profile refuses a config it would build otherwise)."""
    model = check_matches_transformers(with_config(ckpt, tmp_path / "s", n_shared_experts=1, moe_layer_freq=[0, 0, 1]),
                                       ARCH, ids)
    assert model.moe_layer_ids == (1, 2) and model.model.layers[1].mlp.shared_experts is None


def test_its_checkpoints_mtp_layers_are_skipped_as_transformers_skips_them(ckpt, tmp_path, ids):
    """The released checkpoints store Multi-Token-Prediction layers under model.mtp.: not part of the model (any
    other unknown tensor is still refused)."""
    import torch

    from loadplan.engine.weights import UnexpectedTensor

    def add_mtp(tensors):
        tensors["model.mtp.layers.0.enorm.weight"] = torch.ones(32)
        tensors["model.mtp.layers.0.eh_proj.weight"] = torch.zeros(32, 64)
    with_mtp = with_tensors(ckpt, tmp_path / "mtp", add_mtp)
    torch.testing.assert_close(logits_of(load_local(with_mtp), ids), logits_of(load_local(ckpt), ids))

    def add_other(tensors):
        tensors["model.extra.weight"] = torch.ones(32)
    with pytest.raises(UnexpectedTensor, match=r"model\.extra\.weight"):
        load_local(with_tensors(ckpt, tmp_path / "other", add_other))


@pytest.mark.parametrize("overrides,match", [
    (dict(layer_types=["full_attention", "chunked_attention", "sliding_attention"]), r"config\.layer_types: expected"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     r"config\.rope_parameters: expected one object per layer type"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     r"config\.rope_parameters\.full_attention: partial_rotary_factor 0\.1 of head_dim=12 rotates 1 features"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
