"""bfloat16 experts: the weights kept in bfloat16, the sums in float32 (engine/expert_native.cpp's bfloat16 path, and
the torch implementations in bfloat16), against the float64 reference and against transformers' bfloat16 model."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine import expert_choice, expert_kernel, expert_native
from loadplan.engine.expert_kernel import fused_experts, grouped_expert_mlp
from loadplan.engine.generate import generate
from loadplan.engine.loader import load_model
from loadplan.engine.moe import RoutedExperts
from engine_helpers import LocalRegistry, _transformers, make_checkpoint, prompt
from kernel_helpers import CountOps, expert_reference, make_experts

D, I = 32, 16
BF = torch.bfloat16
QWEN3 = "Qwen3MoeForCausalLM"

# The kernel sums in float32 and rounds once, to the output's bfloat16 (a relative step of 2^-8): against the
# float64 reference of the same bfloat16 inputs its error is that rounding, a few 1e-3 of the largest output.
KERNEL_RTOL = 1e-2

needs_kernel = pytest.mark.skipif(expert_native.library() is None, reason="no C++ compiler to build the kernel")


def make(S, T, seed=0, d=D, i=I):
    return make_experts(S, T, seed, BF, D=d, I=i)


def close_to_reference(got, x, slots, w, gate_up, down, rtol=KERNEL_RTOL):
    want = expert_reference(x, slots, w, gate_up, down)
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert got.dtype == BF and err <= rtol * scale, f"max |error| {err:.3g} for outputs up to {scale:.3g}"


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_kernel
def test_the_kernel_takes_bfloat16_weights_alike_only():
    x, gate_up, down = make(S=4, T=3)
    assert expert_native.applies(x, gate_up, down)
    assert expert_choice.applies("kernel", x, gate_up, down)
    assert not expert_native.applies(x.float(), gate_up, down)                  # mixed dtypes: not the kernel's
    assert not expert_native.applies(x.half(), gate_up.half(), down.half())
    assert expert_native.features().startswith("tiles=") and "dpbf16=" in expert_native.features()


@needs_kernel
@pytest.mark.parametrize("T", [1, 2, 7, 40, 150])
def test_kernel_matches_the_reference(T, threads):
    S, K = 12, 3
    x, gate_up, down = make(S=S, T=T, seed=T)
    g = torch.Generator().manual_seed(T)
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    close_to_reference(fused_experts(x, slots, weights, gate_up, down, impl="kernel"), x, slots, weights, gate_up,
                       down)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 24, 40, 97, 150])
def test_every_row_count_and_larger_sizes(rows, threads):
    # the dot products (1-2 rows on AVX2, up to 4 on AVX-512) and every tile shape; D=128, I=64: several blocks
    counts = [rows, 0, 1, 20]
    N = sum(counts)
    x, gate_up, down = make(S=4, T=N, seed=rows, d=128, i=64)
    w = torch.rand(N, generator=torch.Generator().manual_seed(rows))
    out = grouped_expert_mlp(x, counts, gate_up, down, row_weights=w)
    slots = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))[:, None]
    close_to_reference(out, x, slots, w[:, None], gate_up, down)


@needs_kernel
@pytest.mark.parametrize("T", [1, 40])
def test_bfloat16_experts_run_in_the_kernel_not_in_torch(T, monkeypatch):
    monkeypatch.setattr(expert_kernel, "EXPERT_PARALLEL", False)               # the op counter sees this thread only
    S, K = 8, 2
    x, gate_up, down = make(S=S, T=T, seed=2)
    g = torch.Generator().manual_seed(2)
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    with CountOps() as ops:
        y = fused_experts(x, slots, weights, gate_up, down, impl="kernel")
    assert not {"mm", "mv", "addmv", "bmm", "_grouped_mm"} & set(ops.calls), ops.calls
    close_to_reference(y, x, slots, weights, gate_up, down)


@needs_kernel
def test_dropped_slots():
    S, T = 6, 40
    x, gate_up, down = make(S=S, T=T, seed=3)
    slots = torch.tensor([[1, S, 1, 4], [0, 0, S + 3, 5]]).repeat(20, 1)
    weights = torch.rand(T, 4)
    close_to_reference(fused_experts(x, slots, weights, gate_up, down, impl="kernel"), x, slots, weights, gate_up,
                       down)


@pytest.fixture(scope="module")
def qwen3_bf16(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint (hidden 64, expert size 32: sizes the kernel takes), transformers' bfloat16
    model of it with its eager experts, the engine's bfloat16 model of it, and transformers' logits and greedy
    tokens."""
    path = make_checkpoint(tmp_path_factory.mktemp("qwen3-bf16"), QWEN3)
    hf = getattr(_transformers(), QWEN3).from_pretrained(path, dtype=BF, attn_implementation="eager",
                                                         experts_implementation="eager").eval()
    ids, p = prompt(), prompt(B=1, T=5, seed=4)
    with torch.no_grad():
        logits = hf(ids, use_cache=False).logits
        tokens = hf.generate(p, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
                             use_cache=False)[0, p.shape[1]:].tolist()
    model = load_model(path, registry=LocalRegistry(), dtype=BF)
    return model, ids, logits, p, tokens


# transformers' bfloat16 model rounds every intermediate to bfloat16; the engine's experts keep float32 sums (the
# kernel) or round where torch's bfloat16 matmuls do: the logits (up to ~5 here) differ by a few bfloat16 steps
BF16_LOGITS_ATOL = 0.125


@pytest.mark.parametrize("impl", expert_choice.IMPLS)
def test_bfloat16_model_matches_transformers_bfloat16(qwen3_bf16, impl):
    if impl == "kernel" and expert_native.library() is None:
        pytest.skip(f"no compiled kernel: {expert_native.unavailable_reason()}")
    model, ids, want, p, hf_tokens = qwen3_bf16
    layers = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert layers and all(m.gate_up_proj.dtype == BF for m in layers)          # the experts are kept in bfloat16
    for m in layers:
        m.experts_impl = impl
    try:
        with torch.no_grad():
            got = model(ids)
        tokens = generate(model, p, 6)[0].tolist()
    finally:
        for m in layers:
            m.experts_impl = None
    assert got.dtype == BF and 0.5 < want.abs().max() < 50
    err = (got.float() - want.float()).abs().max().item()
    print(f"{impl}: max |logit difference| {err:.3g}")
    assert err <= BF16_LOGITS_ATOL, f"{impl}: max |logit difference| {err:.3g}"
    assert tokens == hf_tokens, impl                   # the same greedy tokens (the engine with its cache)
