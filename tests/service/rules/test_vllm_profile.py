"""The vllm profile (service/rules/vllm.py): vLLM 0.32.0's all2all kernels, output_is_reduced() and fusion."""

from __future__ import annotations

import pytest

from loadplan.plan import Keys
from loadplan.service.errors import NotFound
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


def test_the_default_allgather_reducescatter_output_is_not_reduced():
    assert vllm.all2all("").name == "allgather_reducescatter" and not vllm.all2all("").output_is_reduced
    d = decide("qwen3-30b-a3b", tp_size=1, ep_size=8, dp_size=8)
    assert (d[Keys.FORWARD_PATH].value, d[Keys.POST_EXPERTS_ALL_REDUCE].value) == ("normal", True)


def test_sglangs_backend_names_are_not_vllms():
    with pytest.raises(NotFound) as e:
        decide("qwen3-30b-a3b", a2a_backend="deepep")
    assert "deepep_low_latency" in e.value.known
