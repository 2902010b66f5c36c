"""The vllm profile (service/rules/vllm.py): vLLM 0.32.0's all2all kernels, output_is_reduced() and fusion."""

from __future__ import annotations

import pytest

from loadplan.plan import Keys
from loadplan.errors import FailedPrecondition, NotFound
from loadplan.service.rules import vllm
from loadplan.service.rules.resolve import resolve_decisions

from ._fixtures import real_request


def decide(name: str, **kw):
    return resolve_decisions(real_request(name, engine="vllm", device=kw.pop("device", "cuda:9.0"), **kw)).decisions


def test_the_profile_is_named_and_deepseek_is_unfused_outside_rocm_aiter():
    d = decide("deepseek-v3", tp_size=8)
    assert d[Keys.ENGINE_PROFILE].value == "vllm 0.32.0"
    assert d[Keys.SHARED_EXPERTS_FUSION].value is False and "AITER" in d[Keys.SHARED_EXPERTS_FUSION].reason
    assert (d[Keys.FORWARD_PATH].value, d[Keys.POST_EXPERTS_ALL_REDUCE].value) == ("normal", True)


@pytest.mark.parametrize("backend", ["deepep_low_latency", "deepep_high_throughput", "nixl_ep", "mori_low_latency",
                                     "flashinfer_nvlink_one_sided"])
def test_all2all_kernels_run_only_with_ep_and_dp_and_then_skip_the_reduction(backend):
    d = decide("qwen3-30b-a3b", tp_size=1, ep_size=8, dp_size=8, a2a_backend=backend)
    assert (d[Keys.FORWARD_PATH].value, d[Keys.POST_EXPERTS_ALL_REDUCE].value) == ("a2a", False)
    d = decide("qwen3-30b-a3b", tp_size=1, ep_size=8, dp_size=1, a2a_backend=backend)   # DP 1: NoDPEP
    assert (d[Keys.FORWARD_PATH].value, d[Keys.POST_EXPERTS_ALL_REDUCE].value) == ("normal", True)
    assert "use_all2all_kernels" in d[Keys.FORWARD_PATH].reason


@pytest.mark.parametrize("backend", ["", "allgather_reducescatter", "naive"])
def test_the_naive_kernels_dispatch_under_dp_and_ep_but_leave_the_reduction_to_moerunner(backend):
    """NaiveDPEP's output_is_reduced() is false: a2a (use_all2all_kernels), then MoERunner's all-reduce."""
    assert not vllm.all2all(backend).output_is_reduced
    d = decide("qwen3-30b-a3b", tp_size=1, ep_size=8, dp_size=8, a2a_backend=backend)
    assert (d[Keys.FORWARD_PATH].value, d[Keys.POST_EXPERTS_ALL_REDUCE].value) == ("a2a", True)


@pytest.mark.parametrize("tp,dp", [(1, 2), (2, 2), (1, 8)])
def test_dp_without_ep_splits_the_experts_over_dp_times_tp_and_reduces(tp, dp):
    """flatten_tp_across_dp_and_pcp: the experts' TP spans dp x tp devices, so even tp=1 leaves partial sums."""
    d = decide("qwen3-30b-a3b", tp_size=tp, ep_size=1, dp_size=dp)
    assert (d[Keys.FORWARD_PATH].value, d[Keys.POST_EXPERTS_ALL_REDUCE].value) == ("normal", True)
    assert f"tp_size={tp * dp}" in d[Keys.POST_EXPERTS_ALL_REDUCE].reason


def test_an_unsplit_moe_is_not_reduced():
    d = decide("qwen3-30b-a3b", tp_size=1, ep_size=1, dp_size=1)
    assert (d[Keys.FORWARD_PATH].value, d[Keys.POST_EXPERTS_ALL_REDUCE].value) == ("normal", False)


@pytest.mark.parametrize("tp,ep,dp", [(1, 1, 1), (2, 1, 1), (8, 1, 1), (1, 8, 1), (1, 8, 8), (2, 1, 4)])
def test_passthrough_dispatches_in_every_topology_and_its_combine_reduces(tp, ep, dp):
    """use_passthrough_all2all is not gated on use_all2all_kernels; PassThrough's output_is_reduced() is true, so
    no second all-reduce even with tp > 1."""
    d = decide("qwen3-30b-a3b", tp_size=tp, ep_size=ep, dp_size=dp, a2a_backend="passthrough")
    assert (d[Keys.FORWARD_PATH].value, d[Keys.POST_EXPERTS_ALL_REDUCE].value) == ("a2a", False)


@pytest.mark.parametrize("n,size,sizes", [(3, 2, [2, 1]), (5, 4, [1, 1, 2, 1]), (7, 4, [2, 2, 2, 1]),
                                          (61, 4, [15, 15, 16, 15]), (8, 4, [2, 2, 2, 2])])
def test_get_pp_indices_gives_leftover_layers_to_the_stages_before_the_last(n, size, sizes):
    ranges = [vllm.stage_range(n, size, r) for r in range(size)]
    assert [end - start for start, end in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_a_pipeline_stage_without_layers_is_refused():
    with pytest.raises(FailedPrecondition, match="parallel.pp_size"):
        vllm.stage_range(3, 4, 0)


def test_sglangs_backend_names_are_not_vllms():
    with pytest.raises(NotFound) as e:
        decide("qwen3-30b-a3b", a2a_backend="deepep")
    assert "deepep_low_latency" in e.value.known
