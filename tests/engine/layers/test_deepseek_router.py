"""The DeepSeek-V3 gate against transformers' DeepseekV3TopkRouter, and the fused shared slot's weight."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.layers.deepseek_router import DeepseekV3Router, RouterSpec

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

D = 24


def _pair(n_experts, top_k, n_group, topk_group, norm, rsf, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(hidden_size=D, n_routed_experts=n_experts, num_experts_per_tok=top_k,
                                        n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                                        routed_scaling_factor=rsf, num_hidden_layers=1, vocab_size=8)
    ref = hf_ds.DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        ref.weight.normal_()
        # A bias comparable to the scores' spread, so it changes which experts win.
        ref.e_score_correction_bias.normal_(std=0.3)
    ours = DeepseekV3Router(RouterSpec(D, n_experts, top_k, n_group, topk_group, norm, rsf), **kw)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _sorted(ids, w):
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), w.gather(1, order)


CASES = [(64, 8, 8, 4), (32, 4, 4, 2), (16, 4, 1, 1)]


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("n_experts,top_k,n_group,topk_group", CASES)
def test_matches_transformers(n_experts, top_k, n_group, topk_group, norm):
    ref, ours = _pair(n_experts, top_k, n_group, topk_group, norm, rsf=2.5)
    x = torch.randn(50, D)
    _, ref_w, ref_ids = ref(x)
    ids, w = ours(x)
    assert ids.shape == w.shape == (50, top_k)
    ref_ids, ref_w = _sorted(ref_ids, ref_w)
    ids, w = _sorted(ids, w)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-6)


def test_group_limit_and_bias_take_effect():
    """Selected experts lie in at most topk_group groups, and the bias changes the choice."""
    _, ours = _pair(64, 8, 8, 2, True, 2.5)
    x = torch.randn(50, D)
    ids, _ = ours(x)
    assert max(torch.unique(r // 8).numel() for r in ids) <= 2
    with torch.no_grad():
        ours.e_score_correction_bias.zero_()
    assert not torch.equal(ids.sort(-1)[0], ours(x)[0].sort(-1)[0])


def _moe_output(ids, w, expert_out):
    """sum_k w[t,k] * expert_out[ids[t,k], t]: what the experts kernel computes."""
    T = ids.shape[0]
    return (w[..., None] * expert_out[ids, torch.arange(T)[:, None]]).sum(1)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("rsf", [2.5, 1.0, 0.7])
def test_fused_shared_slot_counts_once(norm, rsf):
    """Fused (shared as slot E) equals unfused shared(x) + routed(x), with and without renormalisation."""
    E, T = 32, 20
    _, unfused = _pair(E, 4, 4, 2, norm, rsf)
    fused = DeepseekV3Router(RouterSpec(D, E, 4, 4, 2, norm, rsf), num_fused_shared_experts=1)
    fused.load_state_dict(unfused.state_dict())
    x = torch.randn(T, D)
    expert_out = torch.randn(E + 1, T, D)  # slot E plays the shared expert
    ids, w = unfused(x)
    f_ids, f_w = fused(x)
    assert f_ids.shape == (T, 5)
    assert torch.equal(f_ids[:, -1], torch.full((T,), E))
    assert torch.equal(f_ids[:, :-1], ids)
    torch.testing.assert_close(f_w[:, -1], torch.ones(T))
    expected = _moe_output(ids, w, expert_out) + expert_out[E]
    torch.testing.assert_close(_moe_output(f_ids, f_w, expert_out), expected, rtol=1e-6, atol=1e-6)


def test_design_formula_when_renormalised():
    """DESIGN 5.3: fused column = sum(routed)/rsf before renormalisation -> 1/rsf of the routed total after."""
    rsf = 2.5
    _, unfused = _pair(32, 4, 4, 2, True, rsf)
    fused = DeepseekV3Router(RouterSpec(D, 32, 4, 4, 2, True, rsf), num_fused_shared_experts=1)
    fused.load_state_dict(unfused.state_dict())
    _, w = fused(torch.randn(10, D))
    # after the final x rsf, routed weights sum to rsf and the shared one is rsf * (1/rsf)
    torch.testing.assert_close(w[:, :-1].sum(-1), torch.full((10,), rsf))
    torch.testing.assert_close(w[:, -1], torch.ones(10))


def test_fused_shared_expert_scale_multiplies_only_the_shared_column():
    _, base = _pair(32, 4, 4, 2, True, 2.5)
    half = DeepseekV3Router(RouterSpec(D, 32, 4, 4, 2, True, 2.5), num_fused_shared_experts=1,
                            fused_shared_expert_scale=0.5)
    half.load_state_dict(base.state_dict())
    x = torch.randn(10, D)
    ids, w = base(x)
    h_ids, h_w = half(x)
    torch.testing.assert_close(h_w[:, :-1], w)
    torch.testing.assert_close(h_w[:, -1], torch.full((10,), 0.5))


def test_parameter_names_follow_the_checkpoint():
    assert set(DeepseekV3Router(RouterSpec(D, 16, 2)).state_dict()) == {"weight", "e_score_correction_bias"}


def test_more_than_one_fused_slot_is_refused():
    with pytest.raises(ValueError, match="supported: 0, 1"):
        DeepseekV3Router(RouterSpec(D, 16, 2), num_fused_shared_experts=2)
