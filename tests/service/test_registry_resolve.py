"""Registry.resolve and request_fingerprint: what the store is handed for one resolve.

The request fingerprint decides replay (same request id, same fingerprint) or refusal (same
id, different request), so it must be equal exactly when two requests are equal but for their
request id, whichever way it is computed (from the configs, or from their fingerprints)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from loadplan.plan import Parallel, ResolveRequest, Runtime
from loadplan.service.registry import NewPlan, Registry, request_fingerprint
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
    # As Registry.new_plan computes it: the configs' fingerprints from the rules' deployment inputs.
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
    if isinstance(value, tuple):        # the runtime's engine inputs: (name, value) pairs
        return (*value, ("EXTRA", "1"))
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


def test_resolve_hands_the_store_the_plan_its_fingerprint_and_the_deployment_inputs():
    store = RecordingStore()
    registry = Registry(store, clock=lambda: NOW)
    req = ResolveRequest("r1", "d1", parallel=Parallel(ep_size=2, ep_rank=1), config=CONFIG,
                         quantization_config={"quant_method": "fp8"})
    plan = registry.resolve(req, ("key-of", "these configs"))
    new = store.saved[-1]
    # the request as decided (its runtime names the engine) is the one fingerprinted and stored
    assert plan == new.plan.dated() and plan.request == decided(req) and plan.ruleset_version
    assert new.request_fingerprint == request_fingerprint(decided(req))
    assert new.deployment_inputs == resolve_decisions(req).deployment_inputs
    # The store gets the rules' decisions as decided (no time of their own: the plan's); the
    # caller gets them dated.
    assert new.plan.decisions == dict(resolve_decisions(req).decisions)
    assert all(d.decided_at is None for d in new.plan.decisions.values())
    assert plan.created_at == NOW and all(d.decided_at == NOW for d in plan.decisions.values())
    assert uuid.UUID(hex=plan.plan_id).version == 4


def test_resolve_async_saves_through_the_given_save_or_the_stores_save_plan():
    req = ResolveRequest("r1", "d1", config=CONFIG)
    saved: list[NewPlan] = []

    async def save(new: NewPlan):
        saved.append(new)
        return new.plan

    plan = asyncio.run(Registry(RecordingStore(), clock=lambda: NOW, save=save).resolve_async(req))
    assert saved and plan is saved[0].plan
    store = RecordingStore()
    plan = asyncio.run(Registry(store, clock=lambda: NOW).resolve_async(req))
    assert plan is store.saved[0].plan and plan.request == decided(req)
