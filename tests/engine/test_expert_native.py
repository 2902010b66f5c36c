"""engine/expert_native.py (the compiled expert kernel: dot products for few rows, transposed tiles for more)
against the float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loadplan.engine import expert_kernel, expert_native
from loadplan.engine.expert_kernel import fused_experts, grouped_expert_mlp
from kernel_helpers import CountOps, expert_reference, make_experts

D, I = 32, 16                      # the smallest sizes the kernel takes (multiples of 16)

pytestmark = pytest.mark.skipif(expert_native.library() is None, reason="no C++ compiler to build the kernel")


def make(S, T, seed=0, dtype=torch.float32):
    return make_experts(S, T, seed, dtype, D=D, I=I)


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_applies_only_where_it_computes_the_same():
    x, gate_up, down = make(S=4, T=3)
    assert expert_native.applies(x, gate_up, down)
    assert not expert_native.applies(x.double(), gate_up.double(), down.double())
    assert not expert_native.applies(x, gate_up.transpose(1, 2).contiguous().transpose(1, 2), down)
    x8, gu8, dn8 = x, gate_up[:, :16], down[:, :, :8]                                  # I=8: not a multiple of 16
    assert not expert_native.applies(x8, gu8.contiguous(), dn8.contiguous())
    with torch.enable_grad():
        assert not expert_native.applies(x.requires_grad_(), gate_up, down)


@pytest.mark.parametrize("T", [1, 2, 7, 40])
def test_matches_reference(T, threads):
    S, K = 12, 3
    x, gate_up, down = make(S=S, T=T, seed=T)
    g = torch.Generator().manual_seed(T)
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    y = fused_experts(x, slots, weights, gate_up, down, impl="kernel")
    torch.testing.assert_close(y.double(), expert_reference(x, slots, weights, gate_up, down), rtol=1e-5, atol=1e-5)


def rows_ref(x, counts, w, gate_up, down):
    """Row i of grouped_expert_mlp's result, in float64."""
    S = gate_up.shape[0]
    slot_of_row = torch.repeat_interleave(torch.arange(S), torch.tensor(counts))
    return torch.cat([expert_reference(x[i:i + 1], slot_of_row[i:i + 1, None], w[i:i + 1, None], gate_up, down)
                      for i in range(x.shape[0])])


# every tile shape (16-row vectors 0-4 and a half), work items split at 96 rows (97, 150, 200)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 16, 17, 24, 40, 56, 64, 72, 97, 150, 200])
def test_every_row_count(rows, threads):
    # slot 0 gets `rows` rows, slot 2 one row, slot 3 twenty
    counts = [rows, 0, 1, 20]
    N = sum(counts)
    x, gate_up, down = make(S=4, T=N, seed=rows)
    w = torch.rand(N, generator=torch.Generator().manual_seed(rows))
    out = grouped_expert_mlp(x, counts, gate_up, down, row_weights=w)
    torch.testing.assert_close(out.double(), rows_ref(x, counts, w, gate_up, down), rtol=1e-5, atol=1e-5)
    unweighted = grouped_expert_mlp(x, counts, gate_up, down)
    torch.testing.assert_close(unweighted * w[:, None], out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cap", [2, 16])
def test_experts_above_max_rows_go_to_torch(cap, monkeypatch):
    # a build without AVX-512 takes at most max_rows() rows per expert: both paths run in one call
    monkeypatch.setattr(expert_native, "max_rows", lambda: cap)
    monkeypatch.setattr(expert_kernel, "EXPERT_PARALLEL", False)      # the op counter sees this thread only
    counts = [3, 17, 1, 0, 40, 2]
    S, N = len(counts), sum(counts)
    x, gate_up, down = make(S=S, T=N, seed=cap)
    w = torch.rand(N, generator=torch.Generator().manual_seed(cap))
    with CountOps() as ops:
        out = grouped_expert_mlp(x, counts, gate_up, down, row_weights=w)
    assert ops.calls.count("mm") == 2 * sum(n > cap for n in counts)
    torch.testing.assert_close(out.double(), rows_ref(x, counts, w, gate_up, down), rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(cap)
    slots = torch.stack([torch.randperm(S, generator=g)[:3] for _ in range(40)])
    weights = torch.rand(40, 3, generator=g)
    torch.testing.assert_close(fused_experts(x[:40], slots, weights, gate_up, down, impl="kernel").double(),
                               expert_reference(x[:40], slots, weights, gate_up, down), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 6, 150])
def test_dropped_slots_and_repeats(T, threads):
    # T=150: ~110 rows per kept slot, read from x and written to the token's rows through the maps
    S = 6
    x, gate_up, down = make(S=S, T=T, seed=3)
    slots = torch.tensor([[1, S, 1, 4], [0, 0, S + 3, 5]]).repeat(75, 1)[:T]
    weights = torch.rand(T, 4)
    y = fused_experts(x, slots, weights, gate_up, down, impl="kernel")
    torch.testing.assert_close(y.double(), expert_reference(x, slots, weights, gate_up, down), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 9, 100])
def test_same_as_the_torch_path(T, monkeypatch):
    # Every expert's products run in the kernel, except (a build without AVX-512: max_rows() is 2) those of an
    # expert with more rows than max_rows(): those two matmuls run in torch. A token alone (T=1) always goes
    # to the kernel's dot products.
    monkeypatch.setattr(expert_kernel, "EXPERT_PARALLEL", False)      # the op counter sees this thread only
    S, K = 10, 4
    x, gate_up, down = make(S=S, T=T, seed=5)
    g = torch.Generator().manual_seed(T)
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    with CountOps() as ops:
        native = fused_experts(x, slots, weights, gate_up, down, impl="kernel")
    cap = expert_native.max_rows()
    rows = torch.bincount(slots.reshape(-1), minlength=S).tolist()
    to_torch = 0 if cap is None or T == 1 else sum(n > cap for n in rows)
    assert ops.calls.count("mm") == 2 * to_torch, f"max_rows()={cap}, rows per expert {rows}"
    assert not {"mv", "addmv"} & set(ops.calls), "a token's products ran in torch, not the kernel"
    for impl in ("per_expert", "grouped_mm"):
        torch.testing.assert_close(native, fused_experts(x, slots, weights, gate_up, down, impl=impl), rtol=1e-5,
                                   atol=1e-6)


def test_large_activations_stay_finite():
    # silu(a) for a far below zero: exp(-a) overflows to inf and a / inf is -0, not nan
    x, gate_up, down = make(S=2, T=2)
    x = x * 1e3
    y = fused_experts(x, torch.tensor([[0, 1], [1, 0]]), torch.ones(2, 2), gate_up, down, impl="kernel")
    assert torch.isfinite(y).all()
    want = expert_reference(x, torch.tensor([[0, 1], [1, 0]]), torch.ones(2, 2), gate_up, down)
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("counts", [[70, 0, 5], [8, 130, 33]])
def test_larger_sizes(counts, threads):
    # several blocks of 16 along D and I (the tests above: D=32, I=16); float64 reference per expert
    Dl, Il = 128, 64
    g = torch.Generator().manual_seed(sum(counts))
    N = sum(counts)
    x = torch.randn(N, Dl, generator=g)
    gate_up = torch.randn(len(counts), 2 * Il, Dl, generator=g) / Dl ** 0.5
    down = torch.randn(len(counts), Dl, Il, generator=g) / Il ** 0.5
    w = torch.rand(N, generator=g)
    out = grouped_expert_mlp(x, counts, gate_up, down, row_weights=w)
    expect, a = [], 0
    for s, n in enumerate(counts):
        xs, gu = x[a:a + n].double(), gate_up[s].double()
        h = F.silu(xs @ gu[:Il].t()) * (xs @ gu[Il:].t()) * w[a:a + n, None].double()
        expect.append(h @ down[s].double().t())
        a += n
    torch.testing.assert_close(out.double(), torch.cat(expect), rtol=1e-5, atol=1e-5)
