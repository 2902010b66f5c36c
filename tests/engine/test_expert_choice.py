"""engine/expert_choice.py: the experts implementation measured per shape class and machine, cached, forced by
LOADPLAN_EXPERTS_IMPL; every implementation keeps matching transformers' logits."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from loadplan.engine import expert_choice, expert_native
from loadplan.engine.expert_kernel import fused_experts
from loadplan.engine.loader import load_model
from engine_helpers import LocalRegistry, hf_logits_of_order_one, make_checkpoint, prompt
from kernel_helpers import expert_reference, make_experts

D, I = 32, 16
QWEN3 = "Qwen3MoeForCausalLM"


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """Choices cached in tmp_path (the compiled kernel itself stays in the user's cache: one build)."""
    monkeypatch.setattr(expert_choice, "_path", lambda: tmp_path / "expert_choice_test.json")
    monkeypatch.delenv(expert_choice.ENV, raising=False)
    expert_choice.forget()
    yield tmp_path / "expert_choice_test.json"
    expert_choice.forget()


def routed(T, S=6, K=2, seed=0):
    x, gate_up, down = make_experts(S, T, seed, D=D, I=I)
    g = torch.Generator().manual_seed(seed)
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    return x, slots, torch.rand(T, K, generator=g), gate_up, down


def test_measures_once_per_shape_class_keeps_the_fastest_and_caches_it(fresh, caplog):
    x, slots, w, gate_up, down = routed(T=3)
    calls = []

    def run(impl, n):                    # a fake timing target: per_expert is the slow one
        calls.append(impl)
        if impl == "per_expert":
            torch.mm(torch.ones(300, 300), torch.ones(300, 300))

    with caplog.at_level(logging.INFO, logger=expert_choice.__name__):
        first = expert_choice.choose(x, slots, gate_up, down, run)
        again = expert_choice.choose(x[:2], slots[:2], gate_up, down, run)      # T=2: the same class (<= 4)
    assert first == again != "per_expert"
    assert set(calls) == {c for c in expert_choice.IMPLS if expert_choice.applies(c, x, gate_up, down)}
    assert len(calls) >= 2 * expert_choice.MIN_REPS and calls.count("per_expert") == calls.count(first)
    n = len(calls)
    key = expert_choice.shape_class(x, slots, gate_up, down)
    assert json.loads(fresh.read_text()) == {key: first}
    assert sum("measured" in r.getMessage() for r in caplog.records) == 1           # logged once
    expert_choice.forget()                                                          # a new process: the file
    assert expert_choice.choose(x, slots, gate_up, down, run) == first and len(calls) == n
    x16, slots16 = torch.randn(16, D), torch.zeros(16, 2, dtype=torch.long)         # another class measures
    expert_choice.choose(x16, slots16, gate_up, down, run)
    assert len(calls) > n and len(json.loads(fresh.read_text())) == 2


def test_shape_classes():
    assert [expert_choice.t_bucket(T) for T in (1, 2, 4, 5, 16, 17, 512, 513)] == [1, 4, 4, 16, 16, 64, 1024, 1024]
    x, slots, _, gate_up, down = routed(T=1)
    key = expert_choice.shape_class(x, slots, gate_up, down)
    assert key.startswith("float32/T1/K2/S6/D32/I16/threads")
    assert expert_choice.shape_class(x.double(), slots, gate_up, down) != key


def test_env_forces_an_implementation_and_refuses_unknown_names(fresh, monkeypatch):
    x, slots, w, gate_up, down = routed(T=5)
    ran = []
    for impl in expert_choice.IMPLS:
        if not expert_choice.applies(impl, x, gate_up, down):
            continue
        monkeypatch.setenv(expert_choice.ENV, impl)
        assert expert_choice.choose(x, slots, gate_up, down, lambda impl, n: ran.append(impl)) == impl
    assert ran == [] and not fresh.exists()                                         # nothing measured
    monkeypatch.setenv(expert_choice.ENV, "cuda_magic")
    with pytest.raises(ValueError, match=expert_choice.ENV):
        fused_experts(x, slots, w, gate_up, down)
    with pytest.raises(ValueError, match="impl="):
        fused_experts(x, slots, w, gate_up, down, impl="cuda_magic")


def test_forced_kernel_on_weights_it_cannot_compute_runs_per_expert(fresh, monkeypatch):
    x, slots, w, gate_up, down = (t.double() if t.is_floating_point() else t for t in routed(T=4))
    monkeypatch.setenv(expert_choice.ENV, "kernel")
    assert expert_choice.choose(x, slots, gate_up, down, lambda impl, n: None) == "per_expert"
    y = fused_experts(x, slots, w, gate_up, down)
    torch.testing.assert_close(y, expert_reference(x, slots, w, gate_up, down), rtol=1e-9, atol=1e-9)


def test_without_a_compiler_the_choice_is_among_the_others_with_the_reason_logged(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(OSError, match="no-such-compiler-here"):
        expert_native._build()
    monkeypatch.setattr(expert_native, "_TRIED", False)
    monkeypatch.setattr(expert_native, "_OPS", None)
    monkeypatch.setattr(expert_native, "_REASON", "")
    with caplog.at_level(logging.INFO):
        assert expert_native.library() is None
        x, slots, w, gate_up, down = routed(T=2)
        seen = set()
        impl = expert_choice.choose(x, slots, gate_up, down, lambda impl, n: seen.add(impl))
        y = fused_experts(x, slots, w, gate_up, down)
    assert "no-such-compiler-here" in expert_native.unavailable_reason()
    assert seen == {"grouped_mm", "per_expert"} and impl in seen
    text = caplog.text
    assert "compiled kernel is unavailable" in text and "no-such-compiler-here" in text
    torch.testing.assert_close(y.double(), expert_reference(x, slots, w, gate_up, down), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), QWEN3)


@pytest.mark.parametrize("impl", expert_choice.IMPLS)
def test_every_implementation_matches_transformers_logits(qwen3, impl, monkeypatch):
    # hidden 64, expert size 32: sizes the compiled kernel takes; 14 tokens (prefill) and 1 (decode)
    if impl == "kernel" and expert_native.library() is None:
        pytest.skip(f"no compiled kernel: {expert_native.unavailable_reason()}")
    monkeypatch.setenv(expert_choice.ENV, impl)
    model = load_model(qwen3, registry=LocalRegistry())
    for ids in (prompt(), prompt(B=1, T=1, seed=3)):
        want = hf_logits_of_order_one(qwen3, QWEN3, ids)
        with torch.no_grad():
            got = model(ids)
        assert (got - want).abs().max().item() <= 1e-3, impl


def test_grouped_mm_is_no_candidate_for_rows_it_cannot_stride(fresh):
    """grouped_mm refuses operands whose row stride is not a multiple of 16 bytes (an intermediate
    size a tensor-parallel shard made odd, in bfloat16): the choice leaves it out, and every
    implementation it keeps computes the experts."""
    S, T, K = 4, 3, 2
    x, gate_up, down = make_experts(S, T, 0, torch.bfloat16, D=D, I=9)
    slots = torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.rand(T, K)
    assert not expert_choice.applies("grouped_mm", x, gate_up, down)
    assert expert_choice.applies("grouped_mm", *make_experts(S, T, 0, torch.bfloat16, D=D, I=16))
    want = expert_reference(x.float(), slots, weights, gate_up.float(), down.float())
    got = fused_experts(x, slots, weights, gate_up, down)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


def test_choices_are_cached_per_kernel_source(tmp_path, monkeypatch):
    # a choice measured before the kernel computed bfloat16 (or changed speed) is not read back for the new kernel
    src = tmp_path / "expert_native.cpp"
    src.write_text("// one version")
    monkeypatch.setattr(expert_native, "CPP", src)
    first = expert_choice._path()
    assert expert_native.cpu_key() in first.name
    src.write_text("// another version")
    assert expert_choice._path() != first and expert_choice._path().parent == first.parent


def test_bfloat16_is_measured_with_the_kernel_among_the_candidates(fresh):
    if expert_native.library() is None:
        pytest.skip(f"no compiled kernel: {expert_native.unavailable_reason()}")
    x, gate_up, down = make_experts(6, 3, 0, torch.bfloat16, D=D, I=I)
    slots = torch.tensor([[0, 1], [2, 3], [4, 5]])
    seen = set()
    impl = expert_choice.choose(x, slots, gate_up, down, lambda impl, n: seen.add(impl))
    assert seen == set(expert_choice.IMPLS) and impl in seen

