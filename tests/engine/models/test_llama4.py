"""Llama 4 (text) from save_pretrained checkpoints (`feed_forward.*`, experts stacked with gate and up concatenated):
logits and greedy tokens against transformers, float32; each of its own mechanisms shown to matter and to match
(chunked attention, NoPE layers and their temperature, the L2 q/k norm, Llama 3 rope scaling, top-k of a sigmoid
router scaling the experts' inputs); the stacked experts read per expert; refusals by field. Every backend on
EP 2 and TP 2: tests/engine/parallel; the registry's gate: tests/service/rules."""

from __future__ import annotations

import json

import pytest
import torch

from loadplan.engine.checkpoint import Checkpoint
from loadplan.engine.expert_kernel import general_experts, silu_mul
from loadplan.engine.generate import generate
from loadplan.engine.models.config import ConfigError
from loadplan.engine.models.llama4 import LLAMA4_NAMES, Llama4Attention
from loadplan.engine.moe import RoutedExperts
from loadplan.engine.stacked_experts import StackedExperts
from loadplan.plan import Keys

from engine_helpers import (check_refused_before_any_plan, hf_greedy, hf_logits_of_order_one, load_local, logits_of,
                            make_llama4_checkpoint, make_llama4_wrapper_checkpoint, prompt, with_config)

ARCH = "Llama4ForCausalLM"
TOL = 1e-4
N_NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_llama4_checkpoint(tmp_path_factory.mktemp("llama4"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=9)          # three chunks of 4 (the last one partial)


@pytest.fixture(scope="module")
def reference(ckpt, ids):
    return hf_logits_of_order_one(ckpt, ARCH, ids)


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids, reference):
    model = load_local(ckpt)
    fusion = model.plan.decisions[Keys.SHARED_EXPERTS_FUSION]
    assert (fusion.value, fusion.rule) == (False, "llama4.structural.input_scaled_experts")
    assert model.moe_layer_ids == (1, 3)
    layers = model.model.layers
    assert [isinstance(layer.mlp.experts, RoutedExperts) if hasattr(layer.mlp, "experts") else False
            for layer in layers] == [False, True, False, True]
    assert layers[0].mlp.gate_proj.weight.shape[0] == 48 and layers[1].mlp.shared_expert.gate_proj.weight.shape[0] == 32
    attn = [layer.self_attn for layer in layers]
    assert all(isinstance(a, Llama4Attention) for a in attn)
    assert [(a.rotates, a.chunk_size, a.l2_eps is not None, a.temperature) for a in attn] == \
        [(True, 4, True, None)] * 3 + [(False, None, False, (2.0, 0.1))]
    assert (logits_of(model, ids) - reference).abs().max().item() <= TOL
    assert generate(model, ids[0], N_NEW)[0].tolist() == hf_greedy(ckpt, ARCH, ids[0].tolist(), N_NEW)


@pytest.mark.parametrize("overrides", [
    {"attention_chunk_size": 2},                                        # narrower chunks
    {"layer_types": ["full_attention"] * 4},                            # no chunking
    {"no_rope_layers": [1, 0, 1, 0], "layer_types": ["chunked_attention", "full_attention"] * 2},
    {"use_qk_norm": False},
    {"attn_temperature_tuning": False},
    {"floor_scale": 1, "attn_scale": 0.5},
    {"num_experts_per_tok": 2},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
])
def test_its_config_fields_match_transformers_and_bite(ckpt, ids, reference, tmp_path, overrides):
    changed = with_config(ckpt, tmp_path / "changed", **overrides)
    want = hf_logits_of_order_one(changed, ARCH, ids)
    assert (want - reference).abs().max().item() > 1e-2
    model = load_local(changed)
    assert (logits_of(model, ids) - want).abs().max().item() <= TOL
    if "attention_chunk_size" in overrides or "no_rope_layers" in overrides:    # the cache across chunks
        assert generate(model, ids[0], N_NEW)[0].tolist() == hf_greedy(changed, ARCH, ids[0].tolist(), N_NEW)


def test_a_config_that_leaves_out_the_layer_lists_reads_transformers_defaults(ckpt, ids, reference, tmp_path):
    """no_rope_layers (NoPE every 4th), layer_types (chunked where rotating) and moe_layers (every
    interleave_moe_layer_step-th) as transformers derives them."""
    cfg = json.loads((ckpt / "config.json").read_text())
    for name in ("no_rope_layers", "layer_types", "moe_layers"):
        cfg.pop(name)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    (bare / "config.json").write_text(json.dumps(cfg))
    assert (logits_of(load_local(bare), ids) - reference).abs().max().item() <= TOL


def test_the_experts_kernel_scales_their_inputs():
    """weight_inputs: y[t] = sum_k down_e(act(gate_up_e(w[t, k] * x[t]))), not w times the output."""
    g = torch.Generator().manual_seed(0)
    S, D, I, T, K = 3, 8, 4, 5, 2
    gate_up, down = torch.randn(S, 2 * I, D, generator=g), torch.randn(S, D, I, generator=g)
    x, w = torch.randn(T, D, generator=g), torch.rand(T, K, generator=g) + 0.2
    slots = torch.tensor([[0, 1], [2, 3], [1, 1], [0, 2], [3, 3]])          # 3: not held here
    want = torch.zeros(T, D)
    scaled_outputs = torch.zeros(T, D)
    for t in range(T):
        for k in range(K):
            s = int(slots[t, k])
            if s < S:
                want[t] += down[s] @ silu_mul((gate_up[s] @ (w[t, k] * x[t]))[None])[0]
                scaled_outputs[t] += w[t, k] * (down[s] @ silu_mul((gate_up[s] @ x[t])[None])[0])
    got = general_experts(x, slots, w, gate_up, down, weight_inputs=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - scaled_outputs).abs().max() > 1e-2


def test_stacked_experts_are_shown_per_expert_with_gate_and_up_concatenated(ckpt):
    raw = Checkpoint(ckpt)
    view = StackedExperts(raw, 4, gate_up="concatenated")
    gate_up = raw.get("model.layers.3.feed_forward.experts.gate_up_proj")      # [E, D, 2I]
    down = raw.get("model.layers.3.feed_forward.experts.down_proj")            # [E, I, D]
    assert torch.equal(view.get("model.layers.3.feed_forward.experts.2.gate_proj.weight"), gate_up[2, :, :32].t())
    assert torch.equal(view.get("model.layers.3.feed_forward.experts.2.up_proj.weight"), gate_up[2, :, 32:].t())
    assert torch.equal(view.get("model.layers.3.feed_forward.experts.2.down_proj.weight"), down[2].t())
    assert LLAMA4_NAMES.to_engine("model.layers.3.feed_forward.experts.2.up_proj.weight") == \
        "model.layers.3.mlp.experts.2.up_proj.weight"
    assert LLAMA4_NAMES.to_engine("model.layers.0.feed_forward.gate_proj.weight") == \
        "model.layers.0.mlp.gate_proj.weight"
    assert LLAMA4_NAMES.to_checkpoint("model.layers.1.mlp.shared_expert.down_proj.weight") == \
        "model.layers.1.feed_forward.shared_expert.down_proj.weight"


def test_the_hubs_conditional_generation_checkpoint_runs_text_only_as_transformers(tmp_path, ids):
    """Llama4ForConditionalGeneration: its text model from text_config, read from under `language_model.`; the
    vision model's and projector's tensors skipped; logits equal to those of transformers' text model inside the
    loaded wrapper (its whole-model forward on text alone fails in transformers 5.24: image_outputs)."""
    import transformers

    path = make_llama4_wrapper_checkpoint(tmp_path / "wrapper")
    held = Checkpoint(path).names()
    assert any(n.startswith("vision_model.") for n in held) and any(n.startswith("language_model.") for n in held)
    model = load_local(path)
    assert model.plan.entry_class == "Llama4ForConditionalGeneration"
    assert model.plan.decisions[Keys.SHARED_EXPERTS_FUSION].rule == "llama4.structural.input_scaled_experts"
    hf = transformers.Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                      attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf.language_model(input_ids=ids).logits
    assert 0.5 < want.abs().max() < 50
    assert (logits_of(model, ids) - want).abs().max().item() <= TOL


@pytest.mark.parametrize("overrides, match", [
    ({"no_rope_layers": [1, 1, 0]}, r"config\.no_rope_layers: expected 4 entries of 0 or 1"),
    ({"layer_types": ["sliding_attention"] * 4}, r"config\.layer_types: expected 4 entries"),
    ({"attention_chunk_size": 0}, r"config\.attention_chunk_size: must be an integer >= 1 or null"),
    ({"attention_chunk_size": None}, r"config\.attention_chunk_size: null, but layer_types has chunked_attention"),
    ({"moe_layers": [1, 4]}, r"config\.moe_layers: layer ids must be in \[0, num_hidden_layers=4\)"),
    ({"intermediate_size_mlp": None}, r"config\.intermediate_size_mlp: missing"),
    ({"num_key_value_heads": None}, r"config\.num_key_value_heads: missing"),
    ({"floor_scale": 0}, r"config\.floor_scale: must be > 0"),
    ({"num_experts_per_tok": 5}, r"config\.num_experts_per_tok: 5 exceeds the number of routed experts \(4\)"),
])
def test_a_config_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
