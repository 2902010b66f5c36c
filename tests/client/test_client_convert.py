"""Plans survive proto and back unchanged; the wire keeps integers and floats apart."""

from __future__ import annotations

import datetime as dt

import pytest

from loadplan.client.convert import WireError, plan_from_pb, plan_to_pb, role_from_pb, role_to_pb, timestamp
from loadplan.plan import Decision, LoadPlan, Parallel, ResolveRequest, Runtime

NOW = dt.datetime(2026, 11, 29, 10, 0, 0, 123456, tzinfo=dt.timezone.utc)


def a_plan(**kw) -> LoadPlan:
    req = ResolveRequest("r1", "d1", "speculative", Parallel(tp_size=2, tp_rank=1, pp_size=3, pp_rank=2), "host-a",
                         {"architectures": ["X"], "nested": {"a": [1, 2.5, None]}}, {"quant_method": "fp8"}, "fp8",
                         Runtime(a2a_backend="deepep", device="cuda:9.0", engine="sglang", enable_eplb=True,
                                 ep_num_redundant_experts=2))
    decisions = {
        "a.bool": Decision("a.bool", False, "off because", "r.one", True, 0, NOW),
        "a.int": Decision("a.int", 1, "one", "r.two", True, 0, NOW),
        "a.float": Decision("a.float", 1.0, "scale", "r.three", True, 0, NOW),
        "a.list": Decision("a.list", [3, 7], "range", "r.four", False, 2, NOW),
        "a.str": Decision("a.str", "normal", "path", "r.five", True, 0, None),
    }
    fields = dict(plan_id="p1", ruleset_version="v", request=req, entry_class="X", config_fingerprint="f",
                  quantization="fp8", decisions=decisions, created_at=NOW, replayed=True,
                  history=(decisions["a.int"], decisions["a.list"]))
    fields.update(kw)
    return LoadPlan(**fields)


def test_plan_round_trip():
    plan = a_plan()
    back = plan_from_pb(plan_to_pb(plan))
    # "a.str" has no time of its own: on the wire it was decided with its plan (created_at).
    assert back == plan.dated() != plan and back.decisions["a.str"].decided_at == NOW
    assert type(back.value("a.int")) is int and type(back.value("a.float")) is float


def test_plan_without_optional_parts():
    plan = a_plan(quantization=None, created_at=None, history=(), replayed=False,
                  request=ResolveRequest("r", "d"))
    assert plan_from_pb(plan_to_pb(plan)) == plan


def test_naive_datetimes_are_utc():
    naive = dt.datetime(2026, 1, 2, 3, 4, 5)
    assert timestamp(naive).ToDatetime(tzinfo=dt.timezone.utc) == naive.replace(tzinfo=dt.timezone.utc)
    other = dt.datetime(2026, 1, 2, 5, 4, 5, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert timestamp(other).ToDatetime(tzinfo=dt.timezone.utc) == other


def test_roles():
    for role in ("target", "speculative"):
        assert role_from_pb(role_to_pb(role)) == role
    assert role_from_pb(0) == "target" and role_from_pb(0, None) is None
    with pytest.raises(WireError) as info:
        role_to_pb("draft")
    assert info.value.field == "role"
    with pytest.raises(WireError):
        role_from_pb(9)
