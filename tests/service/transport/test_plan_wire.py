"""`plan_wire.plan_bytes` parses to exactly what `plan_to_pb` builds, for any plan, with or
without the parts a resolve hands it (config texts, unstamped decisions), remembered or not."""

from __future__ import annotations

import dataclasses
import datetime as dt
from types import MappingProxyType

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadplan.client.convert import config_to_json, plan_to_pb, quantization_config_to_json
from loadplan.plan import Decision, LoadPlan, Parallel, ResolveRequest, Runtime
from loadplan.service.transport.plan_wire import plan_bytes
from loadplan.v1 import registry_pb2 as pb

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)   # protobuf strings are UTF-8
long_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=100, max_size=300)   # 2-byte lengths
int32 = st.one_of(st.integers(-2**31, 2**31 - 1), st.integers(0, 200))
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4), max_leaves=10)
config = st.dictionaries(text, json_value, max_size=5)
zones = [None, dt.timezone.utc, dt.timezone(dt.timedelta(hours=-3, minutes=-30))]
when = st.datetimes(min_value=dt.datetime(1900, 1, 1), max_value=dt.datetime(2200, 1, 1), timezones=st.sampled_from(zones))
parallel = st.builds(Parallel, **{f.name: int32 for f in dataclasses.fields(Parallel)})
runtime = st.builds(Runtime, a2a_backend=text, device=text, engine=text, engine_version=text,
                    moe_runner_backend=text, enable_sbo=st.booleans(),
                    enable_tbo=st.booleans(), disable_shared_experts_fusion=st.booleans(),
                    enforce_shared_experts_fusion=st.booleans(), enable_eplb=st.booleans(),
                    ep_num_redundant_experts=int32)
request = st.builds(ResolveRequest, request_id=text, deployment_id=text,
                    role=st.sampled_from(["target", "speculative"]), parallel=parallel, host=text, config=config, quantization_config=st.none() | config,
                    quantization=st.none() | text, runtime=runtime)


def decision(key: str, decided_at) -> st.SearchStrategy[Decision]:
    return st.builds(Decision, key=st.just(key), value=json_value, reason=text | long_text, rule=text,
                     deployment_wide=st.booleans(), revision=int32, decided_at=decided_at)


@st.composite
def plans(draw, decided_at=st.none() | when):
    keys = draw(st.lists(text, max_size=6, unique=True))
    decisions = {k: draw(decision(k, decided_at)) for k in keys}
    history = tuple(draw(st.lists(st.sampled_from(list(decisions.values())), max_size=3))) if decisions else ()
    return LoadPlan(plan_id=draw(text), ruleset_version=draw(text), request=draw(request), entry_class=draw(text),
                    config_fingerprint=draw(text), quantization=draw(st.none() | text), decisions=decisions,
                    created_at=draw(st.none() | when), replayed=draw(st.booleans()), history=history)


def parsed(data: bytes) -> pb.LoadPlan:
    return pb.LoadPlan.FromString(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans())
def test_any_plan_parses_to_plan_to_pb(plan):
    assert parsed(plan_bytes(plan)) == plan_to_pb(plan)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans(decided_at=st.none()), created_at=when)
def test_a_resolved_plan_with_its_known_parts_parses_to_plan_to_pb(plan, created_at):
    # What Registry.resolve_new hands over: decisions before stamping, the config texts as the store keeps them.
    unstamped = plan.decisions
    stamped = LoadPlan(**{**{f.name: getattr(plan, f.name) for f in dataclasses.fields(LoadPlan)},
                          "decisions": {k: dataclasses.replace(d, decided_at=created_at) for k, d in unstamped.items()},
                          "created_at": created_at})
    req = plan.request
    expected = plan_to_pb(stamped)
    # A plain mapping is encoded decision by decision; the rules cache's read-only view as a whole.
    for known in (unstamped, MappingProxyType(dict(unstamped))):
        for _ in range(2):   # the second time from what the first remembered
            got = plan_bytes(stamped, config_json=config_to_json(req.config),
                             quantization_config_json=(None if req.quantization_config is None
                                                       else quantization_config_to_json(req.quantization_config)),
                             unstamped=known)
            assert parsed(got) == expected


def test_one_shared_view_serves_plans_whose_stamps_differ_in_length():
    """A decision's length prefix counts its decided_at, whose encoding is shorter for a whole
    second (no nanos) than for one with microseconds: each plan gets its own lengths."""
    view = MappingProxyType({k: Decision(k, [1, 2], "why " * 40, "r") for k in ("b", "a", "c")})
    base = LoadPlan("p", "v", ResolveRequest("r", "d"), "E", "f", None, {})
    for created_at in (dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
                       dt.datetime(2026, 1, 1, 0, 0, 0, 5, tzinfo=dt.timezone.utc),
                       dt.datetime(2026, 1, 1, 0, 0, 0, 999999, tzinfo=dt.timezone.utc), None):
        stamped = dataclasses.replace(base, created_at=created_at, decisions={
            k: dataclasses.replace(d, decided_at=created_at) for k, d in view.items()})
        assert parsed(plan_bytes(stamped, unstamped=view)) == plan_to_pb(stamped), created_at


def test_an_int32_out_of_range_is_refused_as_the_message_refuses_it():
    plan = LoadPlan("p", "v", ResolveRequest("r", "d", parallel=Parallel(tp_size=2**31)), "E", "f", None, {})
    for encode in (plan_to_pb, plan_bytes):
        try:
            encode(plan)
        except ValueError:
            continue
        raise AssertionError(f"{encode.__name__} accepted tp_size=2**31")
