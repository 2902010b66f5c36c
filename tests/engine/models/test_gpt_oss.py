"""gpt-oss from save_pretrained checkpoints (experts stacked, gate/up interleaved): logits and greedy tokens against
transformers, float32; what sets it apart each shown to matter (the sinks, the per-layer window, the clamp of its
SwiGLU, the router's bias and its softmax after top-k); the stacked tensors shown per expert; refusals by field.
Every backend on EP 2, TP 2 and EP 2 x TP 2: tests/engine/parallel. The shipped gpt-oss-20b config:
test_real_configs.py."""

from __future__ import annotations

import json

import pytest
import torch

from loadplan.engine.checkpoint import Checkpoint
from loadplan.engine.expert_kernel import ClampedSwiGLU, general_experts
from loadplan.engine.generate import generate
from loadplan.engine.models.config import ConfigError
from loadplan.engine.models.gpt_oss import GptOssConfig
from loadplan.engine.stacked_experts import StackedExperts
from loadplan.engine.moe import RoutedExperts
from loadplan.engine.weights import MissingTensor, ShapeMismatch
from loadplan.plan import Keys

from engine_helpers import (check_refused_before_any_plan, hf_greedy, hf_logits_of_order_one,
                            load_local, logits_of, make_gpt_oss_checkpoint, prompt, with_config, with_tensors)

ARCH = "GptOssForCausalLM"
TOL = 1e-4
N_NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=9)          # longer than the window (4) of layers 0 and 2


@pytest.fixture(scope="module")
def reference(ckpt, ids):
    return hf_logits_of_order_one(ckpt, ARCH, ids)


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids, reference):
    model = load_local(ckpt)
    fusion = model.plan.decisions[Keys.SHARED_EXPERTS_FUSION]
    assert (fusion.value, fusion.rule) == (False, "gpt_oss.no_shared_experts")
    assert model.moe_layer_ids == (0, 1, 2)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [4, None, 4]
    attn = model.model.layers[0].self_attn
    assert tuple(attn.sinks.shape) == (4,) and attn.q_proj.bias is not None and attn.o_proj.bias is not None
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, RoutedExperts) and tuple(experts.gate_up_proj.shape) == (8, 64, 64)
    assert tuple(experts.gate_up_bias.shape) == (8, 64) and tuple(experts.down_bias.shape) == (8, 64)
    assert (logits_of(model, ids) - reference).abs().max().item() <= TOL
    # 8 cached decode steps: the window (through the ring cache) and the sinks with the KV cache
    assert generate(model, ids[0], N_NEW)[0].tolist() == hf_greedy(ckpt, ARCH, ids[0].tolist(), N_NEW)
    # the sliding layers' caches are rings of their window; the full-attention layer's holds every position
    model.setup_caches(1, 32)
    assert [(type(layer.self_attn.kv_cache).__name__, layer.self_attn.kv_cache.k_cache.shape[2])
            for layer in model.model.layers] == [("WindowKVCache", 4), ("KVCache", 32), ("WindowKVCache", 4)]
    model.clear_caches()


@pytest.mark.parametrize("what", ["sinks", "router bias", "expert biases"])
def test_each_of_its_own_tensors_changes_the_logits_and_is_read(ckpt, ids, reference, tmp_path, what):
    """Zeroed, each gives other logits in transformers, and the engine follows (so a tensor read into the wrong
    place, or not used, fails the test above or this one)."""
    suffixes = {"sinks": ("self_attn.sinks",), "router bias": ("mlp.router.bias",),
                "expert biases": ("experts.gate_up_proj_bias", "experts.down_proj_bias")}[what]

    def zero(tensors):
        for name in tensors:
            if name.endswith(suffixes):
                tensors[name] = torch.zeros_like(tensors[name])
    edited = with_tensors(ckpt, tmp_path / "edited", zero)
    want = hf_logits_of_order_one(edited, ARCH, ids)
    assert (want - reference).abs().max().item() > 1e-2
    assert (logits_of(load_local(edited), ids) - want).abs().max().item() <= TOL


@pytest.mark.parametrize("overrides", [
    {"sliding_window": 2},                                            # a narrower window on layers 0 and 2
    {"layer_types": ["full_attention"] * 3},                          # no window at all
    {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
    {"swiglu_limit": 0.3},                                            # the clamp bites
    {"swiglu_alpha": 3.0},
])
def test_its_config_fields_match_transformers_and_bite(ckpt, ids, reference, tmp_path, overrides):
    changed = with_config(ckpt, tmp_path / "changed", **overrides)
    want = hf_logits_of_order_one(changed, ARCH, ids)
    assert (want - reference).abs().max().item() > 1e-2
    model = load_local(changed)
    assert (logits_of(model, ids) - want).abs().max().item() <= TOL
    if "layer_types" in overrides or "sliding_window" in overrides:
        assert generate(model, ids[0], N_NEW)[0].tolist() == hf_greedy(changed, ARCH, ids[0].tolist(), N_NEW)


def test_a_config_without_layer_types_or_rope_reads_transformers_defaults(ckpt, ids, reference, tmp_path):
    """transformers fills in sliding layers on even ids and its YaRN rope (factor 32, truncate false, theta
    150000); so must the engine."""
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg.pop("layer_types") == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg.pop("rope_parameters")["truncate"] is False
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    (bare / "config.json").write_text(json.dumps(cfg))
    parsed = GptOssConfig.from_hf(cfg)
    assert parsed.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (parsed.rope.rope_type, parsed.rope.theta, parsed.rope.factor, parsed.rope.truncate) == \
        ("yarn", 150000.0, 32.0, False)
    assert (logits_of(load_local(bare), ids) - reference).abs().max().item() <= TOL


# --- the stacked experts ------------------------------------------------------------------------

def test_stacked_experts_are_shown_per_expert_de_interleaved(ckpt):
    raw = Checkpoint(ckpt)
    view = StackedExperts(raw, 8, gate_up="interleaved")
    names = set(view.names())
    assert "model.layers.1.mlp.experts.gate_up_proj" not in names
    assert {"model.layers.1.mlp.experts.7.gate_proj.weight", "model.layers.1.mlp.experts.7.up_proj.bias",
            "model.layers.1.mlp.experts.0.down_proj.weight", "model.layers.1.mlp.experts.0.down_proj.bias",
            "model.layers.1.mlp.router.bias", "model.layers.1.self_attn.sinks"} <= names
    gate_up = raw.get("model.layers.1.mlp.experts.gate_up_proj")          # [E, D, 2I] gate/up interleaved
    down = raw.get("model.layers.1.mlp.experts.down_proj")                # [E, I, D]
    bias = raw.get("model.layers.1.mlp.experts.gate_up_proj_bias")        # [E, 2I]
    gate = view.get("model.layers.1.mlp.experts.5.gate_proj.weight")
    assert tuple(gate.shape) == view.shape("model.layers.1.mlp.experts.5.gate_proj.weight") == (32, 64)
    assert torch.equal(gate, gate_up[5, :, 0::2].t())
    assert torch.equal(view.get("model.layers.1.mlp.experts.5.up_proj.weight"), gate_up[5, :, 1::2].t())
    assert torch.equal(view.get("model.layers.1.mlp.experts.5.up_proj.bias"), bias[5, 1::2])
    assert view.shape("model.layers.1.mlp.experts.5.down_proj.weight") == (64, 32)
    assert torch.equal(view.get("model.layers.1.mlp.experts.5.down_proj.weight"), down[5].t())


def test_a_stacked_tensor_of_another_expert_count_is_named(ckpt):
    with pytest.raises(ShapeMismatch,
                       match=r"model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj.* num_local_experts=16"):
        StackedExperts(Checkpoint(ckpt), 16, gate_up="interleaved")


def test_a_missing_stacked_bias_is_named_by_layer(ckpt, tmp_path):
    edited = with_tensors(ckpt, tmp_path / "no_bias", lambda t: t.pop("model.layers.2.mlp.experts.down_proj_bias"))
    with pytest.raises(MissingTensor, match=r"model\.layers\.2\.mlp\.experts\.\d\.down_proj\.bias"):
        load_local(edited)


def test_the_biased_experts_kernel_against_a_loop_over_tokens():
    """The kernel against the definition: per token, the sum over its K experts of w * (down(act(gate_up x + b)) + b),
    with a dropped slot (another rank's expert) and without the down bias (a TP rank other than the first)."""
    g = torch.Generator().manual_seed(0)
    S, D, I, T, K = 4, 16, 8, 6, 2
    gate_up, down = torch.randn(S, 2 * I, D, generator=g), torch.randn(S, D, I, generator=g)
    b_gu, b_d = torch.randn(S, 2 * I, generator=g), torch.randn(S, D, generator=g)
    x, w = torch.randn(T, D, generator=g), torch.rand(T, K, generator=g)
    slots = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 4], [4, 0], [2, 2]])      # 4: not held here
    act = ClampedSwiGLU(1.702, 1.5)
    for down_bias in (b_d, None):
        want = torch.zeros(T, D)
        for t in range(T):
            for k in range(K):
                s = int(slots[t, k])
                if s < S:
                    h = act((gate_up[s] @ x[t] + b_gu[s])[None])[0]
                    want[t] += w[t, k] * (down[s] @ h + (down_bias[s] if down_bias is not None else 0))
        got = general_experts(x, slots, w, gate_up, down, gate_up_bias=b_gu, down_bias=down_bias, act=act)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_clamped_swiglu_clamps_the_gate_above_only_and_up_both_sides():
    act = ClampedSwiGLU(alpha=1.0, limit=2.0)
    gate_up = torch.tensor([[10.0, -10.0, 10.0, -10.0]])                # gate [10, -10], up [10, -10]
    gate = torch.tensor([2.0, -10.0])
    up = torch.tensor([2.0, -2.0])
    torch.testing.assert_close(act(gate_up)[0], (up + 1) * gate * torch.sigmoid(gate))


# --- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, match", [
    ({"layer_types": ["sliding_attention", "full_attention"]}, r"config\.layer_types: expected 3 entries"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, r"config\.layer_types"),
    ({"sliding_window": 0}, r"config\.sliding_window: must be an integer >= 1"),
    ({"sliding_window": None}, r"config\.sliding_window: null, but layer_types has sliding_attention"),
    ({"num_experts_per_tok": 9}, r"config\.num_experts_per_tok: 9 exceeds the number of routed experts \(8\)"),
    ({"num_key_value_heads": None}, r"config\.num_key_value_heads: missing"),
    ({"swiglu_limit": 0}, r"config\.swiglu_limit: must be > 0"),
    ({"swiglu_limit": "7"}, r"config\.swiglu_limit: expected"),
])
def test_a_config_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)

