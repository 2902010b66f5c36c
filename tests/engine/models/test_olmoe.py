"""OLMoE from save_pretrained checkpoints: logits and greedy tokens against transformers, float32; q and k
normalised over the whole projection, clip_qkv; the spelling table that keeps those norms apart from Qwen3's
per-head ones. Every backend on EP 2, and TP 2 (the norm split over the ranks): tests/engine/parallel."""

from __future__ import annotations

import pytest

from loadplan.engine.generate import generate
from loadplan.engine.models.config import ConfigError
from loadplan.engine.models.olmoe import OLMOE_NAMES, olmoe_config
from loadplan.engine.weights import Target, WeightLayout, remap, tp_split_dim
from loadplan.plan import Keys

from engine_helpers import (OLMOE_TINY, hf_greedy, hf_logits_of_order_one, load_local, logits_of,
                            make_olmoe_checkpoint, prompt, with_config)

ARCH = "OlmoeForCausalLM"
TOL = 1e-4
N_NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_olmoe_checkpoint(tmp_path_factory.mktemp("olmoe"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=9)


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = load_local(ckpt)
    fusion = model.plan.decisions[Keys.SHARED_EXPERTS_FUSION]
    assert (fusion.value, fusion.rule) == (False, "olmoe.no_shared_experts")
    assert model.moe_layer_ids == (0, 1, 2)
    attn = model.model.layers[0].self_attn
    assert attn.q_norm is None and attn.k_norm is None                       # not per head ...
    assert attn.q_proj_norm.weight.shape == (64,) and attn.k_proj_norm.weight.shape == (32,)   # ... per projection
    assert model.model.layers[0].mlp.norm_topk_prob is False
    assert (logits_of(model, ids) - hf_logits_of_order_one(ckpt, ARCH, ids)).abs().max().item() <= TOL
    assert generate(model, ids[0], N_NEW)[0].tolist() == hf_greedy(ckpt, ARCH, ids[0].tolist(), N_NEW)


def test_clip_qkv_matches_transformers_and_bites(ckpt, ids, tmp_path):
    clipped = with_config(ckpt, tmp_path / "clip", clip_qkv=0.5)
    want = hf_logits_of_order_one(clipped, ARCH, ids)
    assert (want - hf_logits_of_order_one(ckpt, ARCH, ids)).abs().max().item() > 1e-2
    assert (logits_of(load_local(clipped), ids) - want).abs().max().item() <= TOL


def test_the_projection_norms_are_renamed_and_split_with_their_heads():
    name = "model.layers.2.self_attn.q_norm.weight"
    assert OLMOE_NAMES.to_engine(name) == "model.layers.2.self_attn.q_proj_norm.weight"
    assert OLMOE_NAMES.to_checkpoint(OLMOE_NAMES.to_engine(name)) == name
    tp2 = WeightLayout(n_routed=8, tp_size=2, tp_rank=1, names=OLMOE_NAMES)
    assert remap("model.layers.2.self_attn.k_norm.weight", tp2) == Target("model.layers.2.self_attn.k_proj_norm.weight")
    assert tp_split_dim("model.layers.2.self_attn.k_proj_norm.weight", tp2) == 0
    # Qwen3's per-head norms carry the checkpoint's name and stay whole on every TP rank.
    assert tp_split_dim("model.layers.2.self_attn.k_norm.weight", WeightLayout(n_routed=8, tp_size=2)) is None


@pytest.mark.parametrize("field, value, message", [
    ("clip_qkv", 0, "must be > 0 or null"),
    ("head_dim", 8, "must equal hidden_size=64"),
    ("num_experts", None, "missing"),
    ("num_experts_per_tok", 9, "exceeds the number of routed experts"),
])
def test_config_fields_are_refused_by_name(field, value, message):
    cfg = dict(OLMOE_TINY, architectures=[ARCH])
    cfg[field] = value
    if value is None:
        del cfg[field]
    with pytest.raises(ConfigError, match=rf"config\.{field}: .*{message}"):
        olmoe_config(cfg)
