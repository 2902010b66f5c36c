"""engine/expert_kernel.py against a per-token, per-slot loop written from the formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from loadplan.engine import expert_kernel
from loadplan.engine.expert_kernel import fused_experts, grouped_expert_mlp, sort_by_slot
from kernel_helpers import CountOps, expert_reference, make_experts

D, I = 16, 8


@pytest.fixture(params=["serial", "expert_parallel", "grouped_mm"])
def path(request, monkeypatch):
    """The torch implementations, as the implementation name to pass: both ways of running the per-slot matmuls
    ("per_expert": all on this thread, or whole slots per thread), and torch's grouped_mm. (The compiled
    kernel's own tests: test_expert_native.py.)"""
    monkeypatch.setattr(expert_kernel, "EXPERT_PARALLEL", request.param == "expert_parallel")
    threads = torch.get_num_threads()
    if request.param == "expert_parallel" and threads < 2:
        torch.set_num_threads(2)                                  # the split needs more than one thread
    yield "grouped_mm" if request.param == "grouped_mm" else "per_expert"
    torch.set_num_threads(threads)


def make(S, T, seed=0, dtype=torch.float32):
    return make_experts(S, T, seed, dtype, D=D, I=I)


def topk_slots(T, n_routed, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n_routed, generator=g)[:K] for _ in range(T)])


def check(x, slots, weights, gate_up, down, impl="per_expert"):
    y = fused_experts(x, slots, weights, gate_up, down, impl=impl)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), expert_reference(x, slots, weights, gate_up, down), rtol=1e-5, atol=1e-5)
    return y


@pytest.mark.parametrize("T", [1, 2, 5, 33])
def test_routed_top_k(T, path):
    x, gate_up, down = make(S=8, T=T)
    slots = topk_slots(T, 8, 3, seed=T)
    weights = torch.rand(T, 3, generator=torch.Generator().manual_seed(T))
    check(x, slots, weights, gate_up, down, path)


@pytest.mark.parametrize("T", [1, 4])
def test_experts_with_no_tokens_contribute_nothing(T, path):
    # 32 slots, at most 2 * T hit: most experts have zero rows
    x, gate_up, down = make(S=32, T=T)
    slots = topk_slots(T, 32, 2, seed=3)
    weights = torch.rand(T, 2)
    check(x, slots, weights, gate_up, down, path)
    order, counts = sort_by_slot(slots, 32)
    assert counts.count(0) >= 32 - 2 * T and sum(counts) == 2 * T == order.numel()


@pytest.mark.parametrize("T", [1, 6])
def test_fused_shared_slot_selected_by_every_token(T, path):
    E, K = 8, 2
    x, gate_up, down = make(S=E + 1, T=T)                        # slot E is the fused shared expert
    slots = torch.cat([topk_slots(T, E, K, seed=5), torch.full((T, 1), E)], dim=1)
    weights = torch.cat([torch.rand(T, K), torch.full((T, 1), 0.5)], dim=1)
    y = check(x, slots, weights, gate_up, down, path)
    # the shared slot alone is a dense MLP on every token
    only_routed = fused_experts(x, slots[:, :K], weights[:, :K], gate_up, down, impl=path)
    shared = 0.5 * F.linear(F.silu(F.linear(x, gate_up[E, :I])) * F.linear(x, gate_up[E, I:]), down[E])
    torch.testing.assert_close(y, only_routed + shared, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 7])
def test_dropped_slots_contribute_nothing(T, path):
    S = 6
    x, gate_up, down = make(S=S, T=T)
    slots = topk_slots(T, S, 3, seed=7)
    slots[:, 1] = S                                              # another rank's expert (RoutedExperts' marker)
    slots[0, 2] = S + 9                                          # any id >= S is dropped
    weights = torch.rand(T, 3) + 1
    y = check(x, slots, weights, gate_up, down, path)
    # same as pointing the dropped rows at a real expert with weight 0
    dropped = slots >= S
    zeroed = fused_experts(x, slots.masked_fill(dropped, 0), weights.masked_fill(dropped, 0), gate_up, down,
                           impl=path)
    torch.testing.assert_close(y, zeroed, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 3])
def test_all_slots_dropped_gives_zeros(T):
    x, gate_up, down = make(S=4, T=T)
    y = fused_experts(x, torch.full((T, 2), 4), torch.ones(T, 2), gate_up, down)
    assert torch.equal(y, torch.zeros_like(x))


def test_repeated_slot_in_a_token_counts_twice():
    x, gate_up, down = make(S=4, T=3)
    slots = torch.tensor([[2, 2], [1, 2], [0, 0]])
    check(x, slots, torch.rand(3, 2), gate_up, down)
    check(x[:1], slots[:1], torch.rand(1, 2), gate_up, down)


def test_grouped_expert_mlp_rows_follow_counts(path):
    S = 5
    x, gate_up, down = make(S=S, T=6)
    counts = [2, 0, 3, 0, 1]
    w = torch.rand(6)
    out = grouped_expert_mlp(x, counts, gate_up, down, row_weights=w)
    slot_of_row = [0, 0, 2, 2, 2, 4]
    for i, s in enumerate(slot_of_row):
        ref = expert_reference(x[i:i + 1], torch.tensor([[s]]), w[i:i + 1, None], gate_up, down)
        torch.testing.assert_close(out[i:i + 1].double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):
        grouped_expert_mlp(x, [2, 2], gate_up, down)


def test_weights_in_another_dtype_and_float64_activations():
    x, gate_up, down = make(S=4, T=5, dtype=torch.float64)
    slots = topk_slots(5, 4, 2)
    y = fused_experts(x, slots, torch.rand(5, 2, dtype=torch.float32), gate_up, down)
    assert y.dtype == torch.float64


@settings(max_examples=25, deadline=None)
@given(T=st.integers(0, 9), S=st.integers(1, 7), K=st.integers(1, 4), seed=st.integers(0, 2 ** 16),
       expert_parallel=st.booleans(), impl=st.sampled_from(["per_expert", "grouped_mm"]))
def test_matches_reference_for_any_routing(T, S, K, seed, expert_parallel, impl):
    x, gate_up, down = make(S=S, T=T, seed=seed)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, S + 2, (T, K), generator=g)            # repeats and dropped ids included
    weights = torch.rand(T, K, generator=g)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(expert_kernel, "EXPERT_PARALLEL", expert_parallel)
        check(x, slots, weights, gate_up, down, impl)


@pytest.mark.parametrize("impl", ["per_expert", "grouped_mm"])
def test_matches_transformers_eager_experts(impl):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=8, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    hf = Qwen3MoeExperts(cfg)
    x, gate_up, down = make(S=8, T=9, seed=11)
    with torch.no_grad():
        hf.gate_up_proj.copy_(gate_up)
        hf.down_proj.copy_(down)
        slots = topk_slots(9, 8, 2, seed=11)
        weights = torch.rand(9, 2)
        torch.testing.assert_close(fused_experts(x, slots, weights, gate_up, down, impl=impl), hf(x, slots, weights),
                                   rtol=1e-5, atol=1e-5)


def test_one_matmul_pair_per_hit_slot():
    x, gate_up, down = make(S=8, T=40)
    slots = torch.tensor([[1, 6]]).expand(40, 2)                   # 40 tokens, 2 slots hit
    with CountOps() as c:
        fused_experts(x, slots, torch.rand(40, 2), gate_up, down, expert_parallel=False, impl="per_expert")
    assert c.calls.count("mm") == 4


def test_expert_parallel_restores_the_thread_count_even_on_error():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, gate_up, down = make(S=8, T=40)
        slots = torch.tensor([[1, 6]]).expand(40, 2)
        y = fused_experts(x, slots, torch.rand(40, 2), gate_up, down, expert_parallel=True, impl="per_expert")
        assert torch.get_num_threads() == 2 and y.shape == x.shape
        with pytest.raises(RuntimeError):                             # a down of the wrong width fails
            fused_experts(x, slots, torch.rand(40, 2), gate_up, down[:, :, :3], expert_parallel=True,
                          impl="per_expert")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_expert_parallel_runs_in_the_callers_grad_mode(mode):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, gate_up, down = make(S=8, T=40)
        slots = topk_slots(40, 8, 2)
        weights = torch.rand(40, 2)
        with getattr(torch, mode)():
            y = fused_experts(x, slots, weights, gate_up, down, expert_parallel=True, impl="per_expert")
        torch.testing.assert_close(y.double(), expert_reference(x, slots, weights, gate_up, down), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)
