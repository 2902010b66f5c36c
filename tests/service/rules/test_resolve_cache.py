"""The deployment cache of `resolve_decisions` (rules/resolve.py): a request resolved with an
inputs key (the raw config texts, as the transport passes them) gets exactly what it gets
without one, on a miss and on every later hit, refusals included; the cache stays bounded."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadplan.errors import RegistryError
from loadplan.service.rules import resolve as rules
from loadplan.service.rules.resolve import DEPLOYMENT_CACHE, resolve_decisions

from ._fixtures import REAL_CONFIGS, deepseek, glm4, kimi_k25, load_config, qwen2, qwen3, request

CONFIGS = {"deepseek": deepseek(), "glm4": glm4(), "qwen2": qwen2(), "qwen3": qwen3(), "kimi_k25": kimi_k25(),
           "deepseek_3_dense": deepseek(first_k_dense_replace=3, num_hidden_layers=7),
           "no_architectures": {"num_hidden_layers": 4},
           **{name: load_config(name) for name in REAL_CONFIGS[:2]}}
QCONFIGS = [None, {"quant_method": "fp8", "weight_block_size": [128, 128]}, {"quant_method": "nope"}]


def key_of(req) -> tuple:
    # What the transport passes: texts that determine the parsed configs exactly.
    return (json.dumps(req.config), "" if req.quantization_config is None else json.dumps(req.quantization_config))


def outcome(req, inputs_key=None):
    try:
        return resolve_decisions(req, inputs_key)
    except RegistryError as e:
        return (type(e), e.field, str(e))


@pytest.fixture(autouse=True)
def _empty_cache():
    DEPLOYMENT_CACHE.clear()
    yield
    DEPLOYMENT_CACHE.clear()


ranks = st.fixed_dictionaries({
    "tp_size": st.sampled_from([1, 2]), "ep_size": st.sampled_from([1, 2, 8, 3]),
    "pp_size": st.sampled_from([1, 2, 3, 50]), "dp_size": st.just(1),
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from(sorted(CONFIGS)), qconfig=st.sampled_from(range(len(QCONFIGS))), sizes=ranks,
       rank_picks=st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99), st.integers(-1, 99)),
                           min_size=1, max_size=6),
       backend=st.sampled_from(["none", "deepep", "mooncake", "bogus"]), eplb=st.booleans(),
       redundant=st.sampled_from([0, 8]), request_id=st.sampled_from(["r-1", "", "bad id"]),
       quantization=st.sampled_from([None, "fp8", "x" * 70]))
def test_cache_hit_and_miss_equal_the_uncached_resolution(config, qconfig, sizes, rank_picks, backend, eplb,
                                                          redundant, request_id, quantization):
    for ep_pick, pp_pick, tp_pick in rank_picks:
        # Ranks inside the sizes mostly, one out of range sometimes (a refusal the cache must not hide).
        ranks_ = {"ep_rank": ep_pick % sizes["ep_size"], "pp_rank": pp_pick % sizes["pp_size"],
                  "tp_rank": tp_pick if tp_pick < 0 else tp_pick % sizes["tp_size"]}
        req = request(CONFIGS[config], request_id=request_id, quantization=quantization,
                      quantization_config=QCONFIGS[qconfig], a2a_backend=backend, enable_eplb=eplb,
                      ep_num_redundant_experts=redundant if eplb else 0, **sizes, **ranks_)
        expected = outcome(req)
        assert outcome(req, key_of(req)) == expected      # a miss (or a hit of an earlier rank)
        assert outcome(req, key_of(req)) == expected      # a hit when the first one resolved


def test_ranks_of_one_deployment_hit_the_cache_and_get_their_own_stage():
    cfg = deepseek(num_hidden_layers=8)
    plans = []
    for pp_rank in range(4):
        req = request(cfg, pp_size=4, pp_rank=pp_rank, ep_size=2, ep_rank=pp_rank % 2, enable_eplb=True)
        before = DEPLOYMENT_CACHE.hits
        plans.append(resolve_decisions(req, key_of(req)))
        assert DEPLOYMENT_CACHE.hits == before + (pp_rank > 0)
        assert plans[-1] == resolve_decisions(req)
    assert len({tuple(p.decisions["pp.layer_range"].value) for p in plans}) == 4


def test_a_cached_result_is_shared_but_read_only():
    """Every rank of a deployment stage gets the same decisions and inputs objects (the store and
    the transport encode them once by identity), so nobody may change them."""
    req = request(qwen3())
    first = resolve_decisions(req, key_of(req))
    again = resolve_decisions(dataclasses.replace(req, request_id="r-2"), key_of(req))
    assert again.decisions is first.decisions and again.deployment_inputs is first.deployment_inputs
    for mapping in (first.decisions, first.deployment_inputs):
        with pytest.raises(TypeError):
            mapping[next(iter(mapping))] = None
        with pytest.raises(TypeError):
            del mapping[next(iter(mapping))]
        assert not hasattr(mapping, "clear") and not hasattr(mapping, "update")
    assert resolve_decisions(req, key_of(req)) == resolve_decisions(req)


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(DEPLOYMENT_CACHE, "maxsize", 5)
    for i in range(12):
        req = request(qwen3(num_hidden_layers=4 + i))
        resolve_decisions(req, key_of(req))
    assert len(DEPLOYMENT_CACHE) == 5
    # The most recent ones stay.
    req = request(qwen3(num_hidden_layers=4 + 11))
    before = DEPLOYMENT_CACHE.hits
    resolve_decisions(req, key_of(req))
    assert DEPLOYMENT_CACHE.hits == before + 1


def test_refusals_are_not_cached():
    req = request(qwen3(), ep_size=3)   # 128 experts do not divide over 3
    for _ in range(2):
        assert outcome(req, key_of(req))[0].__name__ == "FailedPrecondition"
    assert len(DEPLOYMENT_CACHE) == 0


def test_default_size_is_bounded():
    assert 0 < rules.DEPLOYMENT_CACHE_SIZE <= 4096
