"""Qwen3-Next from save_pretrained checkpoints (the Hub's per-expert spelling): logits and greedy tokens against
transformers, float32, fused (as planned: the shared expert is as wide as an expert) and unfused; a prompt of
several chunks of the linear attention; the layer kinds read from full_attention_interval; speculative decoding
with a Qwen3-Next target, whose linear-attention states roll back; the MTP module skipped by name; the config
fields it cannot run refused by field. Every backend on EP 2 and TP 2: tests/engine/parallel."""

from __future__ import annotations

import json

import pytest
import torch

from loadplan.engine.layers.attention import GQAttention
from loadplan.engine.layers.gated_delta_net import CHUNK, GatedDeltaNet
from loadplan.engine.models.config import ConfigError
from loadplan.engine.weights import UnexpectedTensor
from loadplan.plan import Keys

from engine_helpers import (check_refused_before_any_plan, hf_greedy, hf_logits_of_order_one, load_local, logits_of,
                            make_fp8_copies, make_qwen3_next_checkpoint, prompt, with_config, with_tensors)

ARCH = "Qwen3NextForCausalLM"
TOL = 1e-4
LONG_TOL = 1e-3
N_NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_next_checkpoint(tmp_path_factory.mktemp("qwen3_next"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=9)


@pytest.fixture(scope="module")
def reference(ckpt, ids):
    return hf_logits_of_order_one(ckpt, ARCH, ids)


def test_logits_and_greedy_tokens_match_transformers_fused_as_planned(ckpt, ids, reference):
    model = load_local(ckpt)
    fusion = model.plan.decisions[Keys.SHARED_EXPERTS_FUSION]
    assert fusion.value is True and model.plan.entry_class == ARCH
    layers = model.model.layers
    assert [type(layer.mixer) for layer in layers] == [GatedDeltaNet] * 3 + [GQAttention]
    assert not hasattr(layers[0], "self_attn") and layers[3].self_attn.output_gate
    assert layers[3].self_attn.rotary_dim == 4                          # partial_rotary_factor 0.25 of 16
    assert layers[0].mlp.experts.num_fused_shared_experts == 1 and layers[0].mlp.shared_expert is None
    assert (logits_of(model, ids) - reference).abs().max().item() <= TOL
    assert generate_tokens(model, ids) == hf_greedy(ckpt, ARCH, ids[0].tolist(), N_NEW)


def generate_tokens(model, ids, n=N_NEW):
    from loadplan.engine.generate import generate

    return generate(model, ids[0], n)[0].tolist()


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    """Two sequences in one batch: each row's linear-attention state is its own."""
    from loadplan.engine.generate import generate

    model = load_local(ckpt)
    both = generate(model, ids, N_NEW).tolist()
    assert both == [generate(model, ids[i], N_NEW)[0].tolist() for i in range(2)]
    assert both[0] != both[1]


def test_a_block_fp8_copy_as_qwen_ships_it_matches_transformers_on_its_weights(ckpt, ids, tmp_path):
    """Every projection in FP8 blocks (the linear attention's in_proj_qkvz, in_proj_ba and out_proj too; Qwen's
    FP8 checkpoints use [128, 128], here [16, 16]); conv, decays, norms, router, embeddings plain."""
    fp8, dequantized, n = make_fp8_copies(ckpt, tmp_path, [16, 16])
    assert n == 3 * 3 + 4 + 4 * (8 + 1) * 3          # linear layers' 3, attention's 4, experts' and shared's
    want = hf_logits_of_order_one(dequantized, ARCH, ids)
    model = load_local(fp8)
    assert model.plan.quantization == "fp8"
    assert (logits_of(model, ids) - want).abs().max().item() <= TOL


def test_unfused_gives_the_same_logits(ckpt, ids, reference):
    model = load_local(ckpt, disable_shared_experts_fusion=True)
    assert model.plan.decisions[Keys.SHARED_EXPERTS_FUSION].value is False
    assert model.model.layers[0].mlp.shared_expert is not None
    assert (logits_of(model, ids) - reference).abs().max().item() <= TOL


def test_a_prompt_of_several_chunks_matches_transformers(ckpt):
    """The chunked form over 2 chunks and a part (and a cache's prefill, then decoding one token at a time).
    Both run the delta rule in float32, whose triangular solves lose digits over a 64-token chunk: measured
    against the rule in float64, transformers' logits are 3.5e-4 off here and the engine's 1.3e-4, hence the
    looser tolerance (tests/engine/layers/test_gated_delta_net.py shows the chunked rule exact in float64)."""
    long_ids = prompt(B=1, T=2 * CHUNK + 9, seed=5)
    want = hf_logits_of_order_one(ckpt, ARCH, long_ids)
    model = load_local(ckpt)
    assert (logits_of(model, long_ids) - want).abs().max().item() <= LONG_TOL
    assert generate_tokens(model, long_ids, 4) == hf_greedy(ckpt, ARCH, long_ids[0].tolist(), 4)


def test_the_layer_kinds_follow_full_attention_interval_when_layer_types_is_absent(ids, tmp_path):
    """Every full_attention_interval-th layer attends (2: layers 1 and 3), as transformers derives it."""
    path = make_qwen3_next_checkpoint(tmp_path / "interval2", full_attention_interval=2, layer_types=None)
    want = hf_logits_of_order_one(path, ARCH, ids)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg.pop("layer_types") == ["linear_attention", "full_attention"] * 2
    (path / "config.json").write_text(json.dumps(dict(cfg, full_attention_interval=2)))   # as the Hub's spell it
    model = load_local(path)
    assert [type(layer.mixer) for layer in model.model.layers] == [GatedDeltaNet, GQAttention] * 2
    assert (logits_of(model, ids) - want).abs().max().item() <= TOL


def test_speculative_decoding_with_a_qwen3_next_target_gives_its_greedy_tokens(ckpt, tmp_path):
    """The target verifies several drafted tokens in one forward and rolls back the rejected ones: its linear
    layers continue from the state of the last accepted position. The draft is the target with a noisy head:
    it agrees often, not always."""
    from loadplan.engine.speculative import speculative_generate

    def noisy_head(tensors):
        g = torch.Generator().manual_seed(4)
        tensors["lm_head.weight"] = tensors["lm_head.weight"] + 0.15 * torch.randn(128, 64, generator=g)
    draft_path = with_tensors(ckpt, tmp_path / "draft", noisy_head)
    ids = prompt(B=1, T=6, seed=2)
    target = load_local(ckpt)
    want = generate_tokens(target, ids, 12)
    tokens, stats = speculative_generate(target, load_local(draft_path, role="speculative"), ids[0], 12, 3)
    assert tokens == want
    assert 0 < stats["accepted"] < stats["proposed"]                   # some rejected: rolled back


def test_the_mtp_module_is_skipped_and_a_tensor_it_does_not_have_is_refused(ckpt, ids, reference, tmp_path):
    def add_mtp(tensors):
        tensors["mtp.fc.weight"] = torch.zeros(64, 128)
        tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    assert (logits_of(load_local(with_tensors(ckpt, tmp_path / "mtp", add_mtp)), ids) - reference).abs().max() <= TOL

    def add_stray(tensors):
        tensors["model.layers.0.linear_attn.in_proj_x.weight"] = torch.zeros(4, 64)
    with pytest.raises(UnexpectedTensor, match=r"model\.layers\.0\.linear_attn\.in_proj_x\.weight"):
        load_local(with_tensors(ckpt, tmp_path / "stray", add_stray))


@pytest.mark.parametrize("overrides, match", [
    ({"hidden_act": "gelu"}, r"config\.hidden_act: 'gelu' not supported; Qwen3-Next runs 'silu'"),
    ({"linear_num_value_heads": 3}, r"config\.linear_num_value_heads: 3 must be a multiple of linear_num_key_heads=2"),
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     r"config\.layer_types: expected 4 entries of linear_attention, full_attention"),
    ({"shared_expert_intermediate_size": 0}, r"config\.shared_expert_intermediate_size: must be >= 1"),
    ({"linear_conv_kernel_dim": None}, r"config\.linear_conv_kernel_dim: missing"),
    ({"num_experts_per_tok": 9}, r"config\.num_experts_per_tok: 9 exceeds the number of routed experts \(8\)"),
])
def test_a_config_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
