"""Registry.resolve_new and request_fingerprint: what the store is handed for one resolve.

The request fingerprint decides replay (same request id, same fingerprint) or refusal (same
id, different request), so it must be equal exactly when two requests are equal but for their
request id, whichever way it is computed (from the configs, or from their fingerprints)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadplan.plan import Parallel, ResolveRequest, Runtime
from loadplan.service.errors import FailedPrecondition, InvalidArgument
from loadplan.service.registry import NewPlan, Registry, new_plan_id, request_fingerprint
from loadplan.service.rules.resolve import fingerprint, resolve_decisions
from sample_requests import decided

CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, "n_routed_experts": 256,
          "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1}
NOW = dt.datetime(2026, 11, 29, 10, 0, 0, 5, tzinfo=dt.timezone.utc)

# Few values per field, so that drawn pairs are often equal in some fields and not in others.
configs = st.sampled_from([CONFIG, dict(reversed(CONFIG.items())), {**CONFIG, "num_hidden_layers": 9}, {"a": [1]}])
qconfigs = st.sampled_from([None, {}, {"quant_method": "fp8"}, {"quant_method": "fp8", "weight_block_size": [128]}])
small = st.sampled_from([0, 1, 2])
requests = st.builds(
    ResolveRequest, request_id=st.sampled_from(["r1", "r2"]), deployment_id=st.sampled_from(["d1", "d2"]),
    role=st.sampled_from(["target", "speculative"]),
    parallel=st.builds(Parallel, **{f.name: small for f in dataclasses.fields(Parallel)}),
    host=st.sampled_from(["", "h"]), config=configs, quantization_config=qconfigs,
    quantization=st.sampled_from([None, "", "fp8"]),
    runtime=st.builds(Runtime, a2a_backend=st.sampled_from(["none", "deepep"]), enable_eplb=st.booleans(),
                      enable_tbo=st.booleans(), ep_num_redundant_experts=small))


def same_but_request_id(a: ResolveRequest, b: ResolveRequest) -> bool:
    return a == dataclasses.replace(b, request_id=a.request_id)


def given_fingerprints(req: ResolveRequest) -> str:
    # As Registry.resolve_new computes it: the configs' fingerprints from the rules' deployment inputs.
    return request_fingerprint(req, fingerprint(dict(req.config)), fingerprint(req.quantization_config or {}))


@settings(max_examples=400, deadline=None)
@given(a=requests, b=requests, shared=st.sets(st.sampled_from([f.name for f in dataclasses.fields(ResolveRequest)])))
def test_fingerprints_are_equal_exactly_when_requests_are_equal_but_for_their_id(a, b, shared):
    b = dataclasses.replace(b, **{name: getattr(a, name) for name in shared})   # often equal, or nearly
    assert (request_fingerprint(a) == request_fingerprint(b)) == same_but_request_id(a, b)
    assert given_fingerprints(a) == request_fingerprint(a)


def test_the_fingerprint_is_the_one_stored_plans_carry():
    """Plans stored by earlier registries carry sha256 of this text (the body's repr, revision "request/2"):
    a retry with their request id is a replay only if the registry computes the same text, however it
    computes it."""
    req = ResolveRequest("r1", "d'1", role="speculative", parallel=Parallel(ep_size=8, ep_rank=3), host="h\u00e9",
                         config=CONFIG, quantization_config={"quant_method": "fp8"}, quantization="fp8",
                         runtime=Runtime(a2a_backend="deepep", enable_eplb=True))
    text = (f"('request/2', '{fingerprint(CONFIG)}', '{fingerprint({'quant_method': 'fp8'})}', "
            f"(\"d'1\", 'speculative', 'h\u00e9', 'fp8'), (1, 0, 8, 3, 1, 0, 1, 0), "
            f"('deepep', 'cpu', '', '', '', False, False, False, False, True, 0))")
    assert request_fingerprint(req) == hashlib.sha256(text.encode()).hexdigest()


def _changed(value):
    """A different value of the same kind, for every kind of field a request has."""
    if dataclasses.is_dataclass(value):
        return None   # its fields are changed one by one
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return "x"
    if isinstance(value, dict):
        return {**value, "extra": 1}
    raise AssertionError(f"no change known for {value!r}: teach _changed this kind of field")


def test_every_field_but_the_request_id_changes_the_fingerprint():
    # Goes through the dataclasses' fields, so a field added later is covered too.
    base = ResolveRequest("r1", "d1", config=CONFIG, quantization_config={"quant_method": "fp8"})
    seen = {request_fingerprint(base)}
    variants = [dataclasses.replace(base, quantization_config=None), dataclasses.replace(base, quantization_config={})]
    for f in dataclasses.fields(ResolveRequest):
        value = getattr(base, f.name)
        if f.name == "request_id":
            assert request_fingerprint(dataclasses.replace(base, request_id="other")) == request_fingerprint(base)
        elif dataclasses.is_dataclass(value):
            variants += [dataclasses.replace(base, **{f.name: dataclasses.replace(value, **{
                g.name: _changed(getattr(value, g.name))})}) for g in dataclasses.fields(value)]
        else:
            variants.append(dataclasses.replace(base, **{f.name: _changed(value)}))
    for v in variants:
        fp = request_fingerprint(v)
        assert fp not in seen, v
        assert given_fingerprints(v) == fp
        seen.add(fp)


class RecordingStore:
    def __init__(self):
        self.saved: list[NewPlan] = []

    def save_plan(self, new: NewPlan):
        self.saved.append(new)
        return new.plan


def test_resolve_new_hands_the_store_the_plan_its_fingerprint_and_the_config_texts():
    store = RecordingStore()
    registry = Registry(store, clock=lambda: NOW)
    req = ResolveRequest("r1", "d1", parallel=Parallel(ep_size=2, ep_rank=1), config=CONFIG,
                         quantization_config={"quant_method": "fp8"})
    got = registry.resolve_new(req, ("key-of", "these configs"), ("config text", "quantization text"))
    new = store.saved[-1]
    assert got.plan is new.plan and got.new is new
    # the request as decided (its runtime names the engine) is the one fingerprinted and stored
    assert new.plan.request == decided(req)
    assert new.request_fingerprint == request_fingerprint(decided(req))
    assert (new.config_json, new.quantization_config_json) == ("config text", "quantization text")
    assert new.deployment_inputs == resolve_decisions(req).deployment_inputs
    plan = new.plan
    assert plan.created_at == NOW and all(d.decided_at == NOW for d in plan.decisions.values())
    assert got.new.unstamped == resolve_decisions(req).decisions
    assert {k: dataclasses.replace(d, decided_at=None) for k, d in plan.decisions.items()} == got.new.unstamped

    # Without texts the store encodes the configs itself; resolve answers the plan alone.
    plan = registry.resolve(dataclasses.replace(req, request_id="r2"))
    assert store.saved[-1].plan is plan
    assert (store.saved[-1].config_json, store.saved[-1].quantization_config_json) == (None, None)


def test_plan_ids_are_random_uuid4_hex():
    ids = [new_plan_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    for plan_id in ids:
        u = uuid.UUID(hex=plan_id)
        assert u.hex == plan_id and u.version == 4 and u.variant == uuid.RFC_4122


ids = st.sampled_from(["r1", "r2", "other-run/7", "a" * 128])


@st.composite
def parallels(draw) -> Parallel:
    """Sizes and ranks the rules accept (most of `requests`' are refused)."""
    sizes = {axis: draw(st.sampled_from([1, 2, 4])) for axis in ("tp", "ep", "pp", "dp")}
    return Parallel(**{f"{axis}_size": n for axis, n in sizes.items()},
                    **{f"{axis}_rank": draw(st.integers(0, n - 1)) for axis, n in sizes.items()})


resolvable = st.builds(
    ResolveRequest, request_id=ids, deployment_id=ids, role=st.sampled_from(["target", "speculative"]),
    parallel=parallels(), host=st.sampled_from(["", "h"]), config=st.sampled_from([CONFIG, {**CONFIG, "n_group": 8}]),
    quantization_config=qconfigs, quantization=st.sampled_from([None, "fp8"]),
    runtime=st.builds(Runtime, a2a_backend=st.sampled_from(["none", "deepep", "mooncake"]), enable_eplb=st.booleans(),
                      enable_tbo=st.booleans(), disable_shared_experts_fusion=st.booleans()))


def _made_twice(registry: Registry, req: ResolveRequest, request_id: str, deployment_id: str):
    """(new_plan of `req` with these ids, new_plan_like of the plan `req` got): both at NOW."""
    first = registry.new_plan(req, (id(req.config), id(req.quantization_config)), ("config text", None))
    direct = registry.new_plan(dataclasses.replace(req, request_id=request_id, deployment_id=deployment_id),
                               (id(req.config), id(req.quantization_config)), ("config text", None))
    return direct, registry.new_plan_like(first, request_id, deployment_id)


@settings(max_examples=300, deadline=None)
@given(req=resolvable, request_id=ids, deployment_id=ids)
def test_a_plan_made_like_an_earlier_one_is_the_plan_its_request_gets(req, request_id, deployment_id):
    """`new_plan_like` (a request of a shape decided before, ResolveLoadPlan's shortcut) hands the
    store what `new_plan` would for that request: same request, decisions, fingerprint, inputs and
    config texts; only the plan id is its own."""
    registry = Registry(RecordingStore(), clock=lambda: NOW)
    try:
        direct, like = _made_twice(registry, req, request_id, deployment_id)
    except (InvalidArgument, FailedPrecondition):
        return   # refused: nothing to make a plan like
    assert like.plan.plan_id != direct.plan.plan_id
    assert dataclasses.replace(like.plan, plan_id="p") == dataclasses.replace(direct.plan, plan_id="p")
    assert like.plan.request.request_id == request_id and like.plan.request.deployment_id == deployment_id
    assert like.request_fingerprint == direct.request_fingerprint
    assert (like.deployment_inputs, like.unstamped) == (direct.deployment_inputs, direct.unstamped)
    assert (like.config_json, like.quantization_config_json) == (direct.config_json, direct.quantization_config_json)


@pytest.mark.parametrize("request_id, deployment_id, field", [
    ("", "d1", "request_id"), ("r 1", "d1", "request_id"), ("r1\n", "d1", "request_id"),
    ("r1", "", "deployment_id"), ("r1", "-d", "deployment_id"), ("r1", "d" * 129, "deployment_id")])
def test_a_plan_made_like_an_earlier_one_checks_its_ids(request_id, deployment_id, field):
    registry = Registry(RecordingStore(), clock=lambda: NOW)
    first = registry.new_plan(ResolveRequest("r0", "d0", config=CONFIG))
    with pytest.raises(InvalidArgument) as err:
        registry.new_plan_like(first, request_id, deployment_id)
    assert err.value.field == field
