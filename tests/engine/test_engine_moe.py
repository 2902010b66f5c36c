"""RoutedExperts: the sorted-token kernel against a naive per-token sum, EP partial sums, plan attributes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from loadplan.engine.moe import RoutedExperts

from engine_helpers import make_plan, qwen2_config

E, D, I, K = 8, 16, 12, 2


def _experts(plan, seed=0) -> RoutedExperts:
    ex = RoutedExperts(E, D, I, plan, layer_id=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) / D ** 0.5)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) / I ** 0.5)
    return ex


def _naive(gate_up, down, x, ids, w):
    """sum_k w[t,k] * expert_{ids[t,k]}(x[t]), one token and one slot at a time; ids index gate_up directly."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            gu = gate_up[ids[t, k]] @ x[t]
            out[t] += w[t, k] * (down[ids[t, k]] @ (F.silu(gu[:I]) * gu[I:]))
    return out


def _routing(T, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return torch.randn(T, D, generator=g), ids, torch.rand(T, K, generator=g)


@pytest.mark.parametrize("T", [1, 5, 33])
def test_sorted_kernel_equals_naive_sum(T):
    ex = _experts(make_plan(qwen2_config(), disable_shared_experts_fusion=True))
    x, ids, w = _routing(T)
    torch.testing.assert_close(ex(x, ids, w), _naive(ex.gate_up_proj, ex.down_proj, x, ids, w),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("ep_size", [1, 2])
def test_a_masked_pick_computes_nothing_whatever_its_weight(T, ep_size):
    """Id -1 (LongCat-Flash's zero-computation experts' picks, models/longcat_flash.py) is no expert, on one rank as
    on EP ranks: not the last expert."""
    full = _experts(make_plan(qwen2_config(), disable_shared_experts_fusion=True))
    x, ids, w = _routing(T)
    masked = ids.clone()
    masked[:, 1] = -1
    total = torch.zeros_like(x)
    for rank in range(ep_size):
        part = RoutedExperts(E, D, I, make_plan(qwen2_config(), ep_size=ep_size, ep_rank=rank,
                                                disable_shared_experts_fusion=True), layer_id=0)
        lo, n = part.local_start, part.num_local_experts
        with torch.no_grad():
            part.gate_up_proj.copy_(full.gate_up_proj[lo:lo + n])
            part.down_proj.copy_(full.down_proj[lo:lo + n])
        part.reduce = lambda y: y          # the all-reduce is the sum here
        total += part(x, masked, w)
    torch.testing.assert_close(total, _naive(full.gate_up_proj, full.down_proj, x, ids[:, :1], w[:, :1]),
                               atol=1e-5, rtol=1e-5)


def test_fused_shared_slot_is_selected_by_every_token_with_its_weight():
    plan = make_plan(qwen2_config())
    ex = _experts(plan)
    assert ex.num_fused_shared_experts == 1 and ex.gate_up_proj.shape[0] == E + 1
    x, ids, w = _routing(6)
    shared_w = torch.rand(6, 1)
    ids2, w2 = ex.append_shared_slots(ids, w, shared_w)
    assert ids2[:, -1].tolist() == [E] * 6 and torch.equal(w2[:, -1:], shared_w)
    torch.testing.assert_close(ex(x, ids2, w2), _naive(ex.gate_up_proj, ex.down_proj, x, ids2, w2),
                               atol=1e-5, rtol=1e-5)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_one_matmul_pair_per_hit_expert_not_per_token(monkeypatch):
    import loadplan.engine.expert_kernel as kernel

    # The dispatch-mode counter is thread-local: keep the matmuls on this thread to count them.
    monkeypatch.setattr(kernel, "EXPERT_PARALLEL", False)
    ex = _experts(make_plan(qwen2_config(), disable_shared_experts_fusion=True))
    ex.experts_impl = "per_expert"              # the torch matmul path (not the measured choice)
    x, ids, w = _routing(64)
    ids[:, 0], ids[:, 1] = 2, 5                 # 64 tokens, 2 experts hit
    with _CountMatmuls() as c:
        ex(x, ids, w)
    assert c.n == 4


def test_expert_parallel_ranks_sum_to_the_whole_and_the_fused_slot_counts_once():
    full = _experts(make_plan(qwen2_config()))
    x, ids, w = _routing(9)
    shared_w = torch.rand(9, 1)
    want = full(x, *full.append_shared_slots(ids, w, shared_w))
    total = torch.zeros_like(want)
    for rank in range(2):
        plan = make_plan(qwen2_config(), ep_size=2, ep_rank=rank)
        part = RoutedExperts(E, D, I, plan, layer_id=0)
        assert part.post_experts_all_reduce and part.fused_shared_expert_scale == 0.5
        assert (part.local_start, part.num_local_experts) == (4 * rank, 4)
        with torch.no_grad():   # this rank's experts, then the (replicated) fused slot
            part.gate_up_proj.copy_(torch.cat([full.gate_up_proj[4 * rank:4 * rank + 4], full.gate_up_proj[E:]]))
            part.down_proj.copy_(torch.cat([full.down_proj[4 * rank:4 * rank + 4], full.down_proj[E:]]))
        calls = []
        part.reduce = lambda y: calls.append(y.clone()) or y     # the all-reduce is the sum below
        total += part(x, *part.append_shared_slots(ids, w, shared_w))
        assert len(calls) == 1
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


def test_no_reduction_unless_the_plan_says_so():
    ex = _experts(make_plan(qwen2_config()))
    assert ex.post_experts_all_reduce is False
    ex.reduce = lambda y: pytest.fail("reduced although the plan says no")
    x, ids, w = _routing(3)
    ex(x, ids, w)


def test_a2a_path_across_ranks_without_a_process_group_is_refused_at_build_time():
    plan = make_plan(qwen2_config(), ep_size=2, a2a_backend="deepep")
    assert plan.decisions["moe.forward_path"].value == "a2a"
    with pytest.raises(RuntimeError, match="forward_path='a2a' with ep_size=2 needs an EP process group"):
        RoutedExperts(E, D, I, plan, layer_id=0)


def test_tp_ranks_split_the_experts_on_the_normal_path_and_keep_them_whole_on_the_a2a_path():
    normal = RoutedExperts(E, D, I, make_plan(qwen2_config(), tp_size=2, tp_rank=1), layer_id=0)
    assert normal.intermediate_size == I // 2 and normal.post_experts_all_reduce
    a2a = RoutedExperts(E, D, I, make_plan(qwen2_config(), tp_size=2, tp_rank=1, a2a_backend="mori"), layer_id=0)
    assert (a2a.forward_path, a2a.post_experts_all_reduce) == ("a2a", False)
    assert a2a.intermediate_size == I and a2a.gate_up_proj.shape[1:] == (2 * I, D)   # complete rows: no reduce


def test_a_normal_path_plan_without_the_reduction_on_tp_ranks_is_refused_not_run():
    """TP-split experts leave every rank a partial sum: a plan that skips the all-reduce is refused by name."""
    plan = make_plan(qwen2_config(), tp_size=2, tp_rank=0)
    key = "moe.post_experts_all_reduce"
    wrong = dict(plan.decisions)
    wrong[key] = dataclasses.replace(wrong[key], value=False, reason="a wrong rule")
    with pytest.raises(ValueError, match=rf"{key} false \(a wrong rule\) on the normal path, but tp_size=2 "
                                         r"splits every expert's intermediate features"):
        RoutedExperts(E, D, I, dataclasses.replace(plan.plan, decisions=wrong), layer_id=0)


def test_eplb_weights_exclude_the_fused_slot_and_alias_the_parameters():
    ex = _experts(make_plan(qwen2_config()))
    gate_up, down = ex.get_moe_weights()
    assert gate_up.shape == (E, 2 * I, D) and down.shape == (E, D, I)
    assert gate_up.data_ptr() == ex.gate_up_proj.data_ptr()
