"""Request validation, sharding, pipeline stages, EPLB, and what makes two ranks
of one deployment agree (DESIGN sections 4-7)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadplan.plan import Keys, Parallel, Runtime
from loadplan.errors import FailedPrecondition, InvalidArgument, NotFound
from loadplan.service.rules import RULESET_VERSION, entries
from loadplan.config_view import ConfigView
from loadplan.service.rules.resolve import (deployment_inputs, diff_deployment_inputs, fingerprint, layout_of,
                                            resolve_decisions, stage_range, validate_request)

from ._fixtures import deepseek, glm4, kimi_k25, qwen2, qwen3, request, resolve

RANK_SPECIFIC = {Keys.PP_LAYER_RANGE, Keys.EPLB_LAYERS}


def invalid(field, config=None, **kw):
    """Resolving raises InvalidArgument naming `field`, in `.field` and in the message."""
    with pytest.raises(InvalidArgument) as e:
        resolve_decisions(request(qwen3() if config is None else config, **kw))
    assert e.value.field == field, e.value
    assert str(e.value).startswith(field + ":"), e.value
    return e.value


# --- request fields -------------------------------------------------------------

@pytest.mark.parametrize("name", ["request_id", "deployment_id"])
@pytest.mark.parametrize("value", ["", " ", "-lead", ".x", "a b", "a\tb", "a" * 129, "abc\n", "é", "a,b", "a#b"])
def test_ill_formed_ids(name, value):
    invalid(name, **{name: value})


@pytest.mark.parametrize("value", ["a", "0", "A" * 128, "req-1.2:3@host/x_y", "dep/2026-11-29"])
def test_well_formed_ids(value):
    validate_request(request(qwen3(), request_id=value, deployment_id=value))


def test_empty_id_says_required():
    assert "required" in str(invalid("request_id", request_id=""))


@pytest.mark.parametrize("role", ["", "draft", "TARGET", "target "])
def test_bad_role(role):
    err = invalid("role", role=role)
    assert "target" in str(err) and "speculative" in str(err)


def test_host_length():
    validate_request(request(qwen3(), host="h" * 255))
    invalid("host", host="h" * 256)


@pytest.mark.parametrize("axis", ["tp", "ep", "pp", "dp"])
@pytest.mark.parametrize("size", [0, -1, -8])
def test_sizes_must_be_positive(axis, size):
    invalid(f"parallel.{axis}_size", **{f"{axis}_size": size})


@pytest.mark.parametrize("axis", ["tp", "ep", "pp", "dp"])
@pytest.mark.parametrize("size,rank", [(1, 1), (2, 2), (4, 7), (2, -1)])
def test_rank_within_size(axis, size, rank):
    invalid(f"parallel.{axis}_rank", **{f"{axis}_size": size, f"{axis}_rank": rank})


def test_redundant_experts():
    invalid("runtime.ep_num_redundant_experts", enable_eplb=True, ep_num_redundant_experts=-1)
    err = invalid("runtime.ep_num_redundant_experts", ep_num_redundant_experts=4)
    assert "enable_eplb" in str(err)


@pytest.mark.parametrize("device", ["", "gpu", "cuda", "cuda:9", "cpu:1.0", "npu:1.0", "hip:9.x"])
def test_bad_device(device):
    invalid("runtime.device", device=device)


def test_moe_runner_backend_only_for_sglang():
    err = invalid("runtime.moe_runner_backend", moe_runner_backend="triton")   # cpu: the loadplan engine
    assert "sglang" in str(err)
    invalid("runtime.moe_runner_backend", engine="vllm", moe_runner_backend="triton")


def test_quantization_config_must_be_an_object():
    invalid("quantization_config", quantization_config=["fp8"])
    invalid("config.quantization_config", config=deepseek(quantization_config="fp8"))


# --- config fields ---------------------------------------------------------------

@pytest.mark.parametrize("bad", [[], "cfg", 3])
def test_config_must_be_an_object(bad):
    invalid("config", config=bad)


@pytest.mark.parametrize("archs", [None, "DeepseekV3ForCausalLM", [], [""], [3], {"a": 1}])
def test_architectures(archs):
    cfg = deepseek()
    if archs is None:
        del cfg["architectures"]
    else:
        cfg["architectures"] = archs
    err = invalid("config.architectures", config=cfg)
    assert ("missing" in str(err)) == (archs is None)


def test_unknown_architecture_is_not_found_listing_the_known_ones():
    with pytest.raises(NotFound) as e:
        resolve(deepseek(architectures=["LlamaForCausalLM"]))
    assert e.value.field == "config.architectures"
    assert "LlamaForCausalLM" in str(e.value)
    assert e.value.known == sorted(entries.ENTRY_CLASSES)
    for known in entries.ENTRY_CLASSES:
        assert known in str(e.value)


@pytest.mark.parametrize("make,field", [
    (deepseek, "n_routed_experts"), (deepseek, "num_hidden_layers"), (deepseek, "num_experts_per_tok"),
    (glm4, "n_routed_experts"), (qwen2, "num_experts"), (qwen3, "num_experts"), (qwen3, "num_hidden_layers"),
    (qwen3, "num_experts_per_tok"),
])
def test_missing_family_fields(make, field):
    cfg = make()
    del cfg[field]
    assert "missing" in str(invalid(f"config.{field}", config=cfg))


@pytest.mark.parametrize("value", ["256", 256.0, True, [256], {"n": 256}])
def test_non_integer_field(value):
    err = invalid("config.n_routed_experts", config=deepseek(n_routed_experts=value))
    assert "integer" in str(err)


def test_wrapper_field_paths():
    invalid("config.text_config", config={"architectures": ["KimiK25ForConditionalGeneration"]})
    body = deepseek(n_routed_experts="384")
    invalid("config.text_config.n_routed_experts", config=kimi_k25(body))


@pytest.mark.parametrize("make,top_k,n", [(deepseek, 257, 256), (qwen3, 129, 128), (qwen2, 65, 64)])
def test_top_k_above_experts(make, top_k, n):
    err = invalid("config.num_experts_per_tok", config=make(num_experts_per_tok=top_k))
    assert str(top_k) in str(err) and str(n) in str(err)


# --- expert sharding and EPLB -------------------------------------------------------

@pytest.mark.parametrize("eplb,redundant,ep,physical,local", [
    (False, 0, 1, 256, 256), (False, 0, 8, 256, 32), (True, 0, 8, 256, 32),
    (True, 32, 8, 288, 36), (True, 16, 16, 272, 17),
])
def test_physical_and_local_experts(eplb, redundant, ep, physical, local):
    d = resolve(deepseek(), enable_eplb=eplb, ep_num_redundant_experts=redundant, ep_size=ep).decisions
    assert d[Keys.EPLB_ENABLED].value is eplb
    assert d[Keys.EPLB_NUM_PHYSICAL_EXPERTS].value == physical
    assert d[Keys.NUM_LOCAL_EXPERTS].value == local
    for k in (Keys.EPLB_ENABLED, Keys.EPLB_NUM_PHYSICAL_EXPERTS, Keys.EPLB_LAYERS, Keys.NUM_LOCAL_EXPERTS):
        assert d[k].reason and d[k].rule


@pytest.mark.parametrize("cfg,kw", [
    (deepseek(), dict(ep_size=3)),
    (deepseek(), dict(ep_size=8, enable_eplb=True, ep_num_redundant_experts=3)),
    (qwen2(num_experts=60, num_experts_per_tok=4), dict(ep_size=8)),
])
def test_experts_must_divide_over_ep(cfg, kw):
    with pytest.raises(FailedPrecondition) as e:
        resolve(cfg, **kw)
    assert "parallel.ep_size" in str(e.value)
    assert f"ep_size={kw['ep_size']}" in str(e.value)


def test_eplb_off_moves_no_layer():
    d = resolve(deepseek()).decisions
    assert d[Keys.EPLB_LAYERS].value == [] and d[Keys.EPLB_ENABLED].value is False
    assert "not enabled" in d[Keys.EPLB_ENABLED].reason


def _moe_layers(cfg, family):
    """Reference MoE layer ids written from the architectures' definitions."""
    n = cfg["num_hidden_layers"]
    if family == "deepseek":
        k, f = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
        return [i for i in range(n) if i >= k and i % f == 0]
    step, only = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers", [])
    return [i for i in range(n) if i not in only and (i + 1) % step == 0]


@pytest.mark.parametrize("cfg,family", [
    (deepseek(num_hidden_layers=13, first_k_dense_replace=3), "deepseek"),
    # A.X K1 reads moe_layer_freq as DeepSeek's own code does (DeepSeek's reader refuses it: transformers does not)
    (deepseek(num_hidden_layers=12, first_k_dense_replace=1, moe_layer_freq=2, architectures=["AXK1ForCausalLM"],
              n_routed_experts=192), "deepseek"),
    (glm4(num_hidden_layers=10, first_k_dense_replace=3), "deepseek"),
    (qwen3(num_hidden_layers=11), "qwen"),
    (qwen2(num_hidden_layers=10), "qwen"),
])
@pytest.mark.parametrize("pp_size", [1, 2, 3, 4])
def test_eplb_layers_are_the_local_moe_layers_of_each_stage(cfg, family, pp_size):
    seen = []
    for pp_rank in range(pp_size):
        d = resolve(cfg, enable_eplb=True, pp_size=pp_size, pp_rank=pp_rank).decisions
        start, end = d[Keys.PP_LAYER_RANGE].value
        layers = d[Keys.EPLB_LAYERS].value
        assert layers == [i for i in _moe_layers(cfg, family) if start <= i < end]
        seen += layers
    assert seen == _moe_layers(cfg, family)


def test_nextn_draft_stage_and_eplb_layers_use_global_ids():
    cfg = deepseek(architectures=["DeepseekV3ForCausalLMNextN"], num_hidden_layers=61)
    d = resolve(cfg, role="speculative", enable_eplb=True).decisions
    assert d[Keys.PP_LAYER_RANGE].value == [61, 62]
    assert d[Keys.EPLB_LAYERS].value == [61]


# --- pipeline stages --------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))))
def test_stages_tile_every_layer(case):
    n_layers, pp_size = case
    ranges = [stage_range(n_layers, pp_size, r) for r in range(pp_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n_layers
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end == start  # no gap, no overlap
    sizes = [e - s for s, e in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # earlier stages take the remainder


@pytest.mark.parametrize("n_layers,pp_size", [(1, 2), (4, 5), (61, 62)])
def test_more_stages_than_layers(n_layers, pp_size):
    with pytest.raises(FailedPrecondition) as e:
        stage_range(n_layers, pp_size, 0)
    assert "parallel.pp_size" in str(e.value)
    with pytest.raises(FailedPrecondition):
        resolve(qwen3(num_hidden_layers=n_layers), pp_size=pp_size)


def test_layer_range_decision():
    d = resolve(deepseek(num_hidden_layers=10), pp_size=3, pp_rank=1).decisions[Keys.PP_LAYER_RANGE]
    assert d.value == [4, 7]
    assert d.rule == "pp.tiling" and "stage 1 of 3" in d.reason and d.deployment_wide is False


# --- decisions: shape ------------------------------------------------------------

DESIGN_KEYS = {Keys.SHARED_EXPERTS_FUSION, Keys.NUM_FUSED_SHARED_EXPERTS, Keys.FUSED_SHARED_EXPERT_SCALE,
               Keys.FORWARD_PATH, Keys.POST_EXPERTS_ALL_REDUCE, Keys.PP_LAYER_RANGE, Keys.EPLB_ENABLED,
               Keys.EPLB_NUM_PHYSICAL_EXPERTS, Keys.EPLB_LAYERS}


@pytest.mark.parametrize("cfg", [deepseek(), glm4(), qwen2(), qwen3(), kimi_k25()], ids=lambda c: c["architectures"][0])
@pytest.mark.parametrize("eplb", [False, True])
def test_every_plan_has_the_design_keys_each_with_reason_and_rule(cfg, eplb):
    d = resolve(cfg, enable_eplb=eplb).decisions
    assert DESIGN_KEYS <= set(d)
    for key, dec in d.items():
        assert dec.key == key and dec.reason and dec.rule
        assert dec.deployment_wide is (key not in RANK_SPECIFIC)


# --- deployment-wide vs rank-specific ---------------------------------------------

def _ranks(cfg, **kw):
    """Every rank of a tp2 x ep2 x pp2 deployment, each its own request id and host."""
    out = []
    for tp in range(2):
        for ep in range(2):
            for pp in range(2):
                out.append(resolve(cfg, request_id=f"r-{tp}{ep}{pp}", host=f"node{tp}{ep}{pp}", tp_size=2,
                                   tp_rank=tp, ep_size=2, ep_rank=ep, pp_size=2, pp_rank=pp, **kw))
    return out


@pytest.mark.parametrize("cfg", [deepseek(), glm4(), qwen2(), qwen3(), kimi_k25(deepseek())],
                         ids=lambda c: c["architectures"][0])
def test_ranks_agree_on_deployment_wide_decisions_and_inputs(cfg):
    ranks = _ranks(cfg, enable_eplb=True, ep_num_redundant_experts=2)
    first = ranks[0]
    for res in ranks[1:]:
        assert res.deployment_inputs == first.deployment_inputs
        for key, dec in res.decisions.items():
            if dec.deployment_wide:
                assert dec == first.decisions[key], key
    # rank-specific decisions follow the pipeline rank only
    by_pp = {}
    for res in ranks:
        pp_range = tuple(res.decisions[Keys.PP_LAYER_RANGE].value)
        by_pp.setdefault(pp_range, []).append(res)
    assert len(by_pp) == 2


BASE = dict(tp_size=2, ep_size=2, pp_size=2, dp_size=2)
RUNTIME_CHANGES = {
    "a2a_backend": "megamoe", "device": "cuda:9.0", "engine": "vllm",
    "moe_runner_backend": "flashinfer_trtllm", "enable_sbo": True, "enable_tbo": True,
    "disable_shared_experts_fusion": True, "enforce_shared_experts_fusion": True, "enable_eplb": True,
    "ep_num_redundant_experts": 2, "engine_args": {"chunked_prefill_size": "8192"},
    "engine_env": {"SGLANG_USE_AITER": "1"}, "upgrade_from": "0.5.22",
}


def _inputs(cfg=None, **kw):
    merged = {**BASE, **kw}
    return resolve(deepseek() if cfg is None else cfg, **merged).deployment_inputs


def test_runtime_changes_cover_every_runtime_field():
    # engine_version follows the engine: asking for the profile's own version changes nothing
    assert set(RUNTIME_CHANGES) | {"engine_version"} == {f.name for f in dataclasses.fields(Runtime)}


def test_asking_for_the_profiles_own_version_or_the_default_engine_changes_nothing():
    on_gpu = _inputs(device="cuda:9.0")
    assert diff_deployment_inputs(on_gpu, _inputs(device="cuda:9.0", engine="sglang")) == []
    assert diff_deployment_inputs(on_gpu, _inputs(device="cuda:9.0", engine_version="0.5.23")) == []


@pytest.mark.parametrize("field", sorted(RUNTIME_CHANGES))
def test_each_runtime_change_is_named_exactly(field):
    # The engine named: a device's default engine would change with the device.
    base = {"engine": "sglang", "device": "cuda:9.0"} if field == "moe_runner_backend" else {"engine": "loadplan"}
    if field == "ep_num_redundant_experts":
        base["enable_eplb"] = True
    a = _inputs(**base)
    b = _inputs(**{**base, field: RUNTIME_CHANGES[field]})
    # another engine is another version too
    changed = [f"runtime.{field}", "runtime.engine_version"] if field == "engine" else [f"runtime.{field}"]
    if field == "upgrade_from":    # names an upgrade, not an input the ranks share (test_registry_observed.py)
        changed = []
    assert diff_deployment_inputs(a, b) == changed


@pytest.mark.parametrize("axis", ["tp", "ep", "pp", "dp"])
def test_each_size_change_is_named_exactly(axis):
    assert diff_deployment_inputs(_inputs(), _inputs(**{f"{axis}_size": 4})) == [f"parallel.{axis}_size"]


def test_rank_host_and_request_id_are_not_deployment_inputs():
    a = _inputs()
    b = _inputs(tp_rank=1, ep_rank=1, pp_rank=1, dp_rank=1, host="other", request_id="another")
    assert diff_deployment_inputs(a, b) == []


def test_config_change_is_named_exactly():
    assert diff_deployment_inputs(_inputs(), _inputs(deepseek(rope_theta=50000))) == ["config_fingerprint"]
    # key order is not a change
    reordered = dict(reversed(list(deepseek().items())))
    assert diff_deployment_inputs(_inputs(), _inputs(reordered)) == []


def test_quantization_changes_are_named_exactly():
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    a = _inputs(quantization_config=fp8)
    assert diff_deployment_inputs(a, _inputs(quantization_config={**fp8, "weight_block_size": [64, 64]})) == \
        ["quantization_config_fingerprint"]
    assert diff_deployment_inputs(a, _inputs(quantization_config={**fp8, "quant_method": "quark"})) == \
        ["quantization", "quantization_config_fingerprint"]
    assert diff_deployment_inputs(a, _inputs(quantization_config=fp8, quantization="w4afp8")) == ["quantization"]


def test_entry_class_change_is_named():
    a = _inputs()
    b = _inputs(deepseek(architectures=["DeepseekV2ForCausalLM"]))
    assert diff_deployment_inputs(a, b) == ["config_fingerprint", "entry_class"]


def test_deployment_inputs_carry_the_ruleset_version():
    assert _inputs()["ruleset_version"] == RULESET_VERSION


def test_diff_deployment_inputs_names_keys_on_one_side_only():
    assert diff_deployment_inputs({"a": 1, "b": 2}, {"a": 1, "c": 2}) == ["b", "c"]
    assert diff_deployment_inputs({"a": 1}, {"a": 1}) == []


def test_deployment_inputs_function_matches_the_resolution():
    req = request(deepseek(), **BASE)
    res = resolve_decisions(req)
    resolved = entries.resolve_entry("DeepseekV3ForCausalLM", ConfigView(req.config), None, None)
    assert deployment_inputs(res.request, resolved, layout_of(res.decisions)) == res.deployment_inputs
    assert res.config_fingerprint == fingerprint(deepseek())


def test_fingerprint_is_canonical():
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    assert fingerprint({"a": 1}) != fingerprint({"a": 1.5})


def test_resolution_is_deterministic():
    assert resolve(kimi_k25(deepseek()), ep_size=2) == resolve(kimi_k25(deepseek()), ep_size=2)


def test_parallel_defaults_are_a_single_rank():
    assert Parallel() == Parallel(1, 0, 1, 0, 1, 0, 1, 0)


@settings(max_examples=60, deadline=None)
@given(sizes=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4, 8]), st.integers(1, 4),
                       st.integers(1, 3)),
       picks=st.tuples(*[st.integers(0, 7)] * 4),
       backend=st.sampled_from(["none", "deepep", "megamoe", "nixl"]),
       eplb=st.booleans())
def test_any_rank_agrees_with_rank_zero(sizes, picks, backend, eplb):
    tp, ep, pp, dp = sizes
    kw = dict(tp_size=tp, ep_size=ep, pp_size=pp, dp_size=dp, a2a_backend=backend, enable_eplb=eplb)
    ranks = dict(tp_rank=picks[0] % tp, ep_rank=picks[1] % ep, pp_rank=picks[2] % pp, dp_rank=picks[3] % dp)
    zero = resolve(deepseek(), **kw)
    mine = resolve(deepseek(), request_id="other", **kw, **ranks)
    assert mine.deployment_inputs == zero.deployment_inputs
    assert {k: d for k, d in mine.decisions.items() if d.deployment_wide} == \
        {k: d for k, d in zero.decisions.items() if d.deployment_wide}
