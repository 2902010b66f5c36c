"""The resolve answer's encoding (`answer_to_pb`) and the request's config parsing, against the
plain translation they shortcut: equal field by field, whatever the plans share."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import pytest
from sample_requests import deepseek_config, request

from loadplan.client.convert import plan_to_pb, request_to_pb
from loadplan.plan import Decision, Parallel, Runtime
from loadplan.errors import InvalidArgument
from loadplan.service.registry import Registry
from loadplan.service.transport.convert import answer_to_pb, request_from_pb

T0 = dt.datetime(2026, 12, 6, 1, 0, 0, 1, tzinfo=dt.timezone.utc)


def decided_plans(reqs):
    """The plans the registry decides for `reqs` as the servicer asks it (through the wire types)."""
    clock = iter(T0 + dt.timedelta(microseconds=i) for i in range(10**6))
    registry = Registry(store=None, clock=lambda: next(clock))
    plans = []
    for req in reqs:
        msg = request_to_pb(req)
        plans.append(registry.new_plan(request_from_pb(msg), (msg.config_json, msg.quantization_config_json)).plan)
    return plans


def test_answers_equal_the_plain_encoding_for_every_rank_of_every_stage():
    reqs = [request(deployment_id=f"dep-{d}", host=f"h{rank}", parallel=Parallel(ep_size=2, ep_rank=rank % 2,
                                                                                pp_size=2, pp_rank=rank // 2),
                    runtime=Runtime(a2a_backend=backend))
            for d, backend in enumerate(("none", "deepep")) for rank in range(4)]
    reqs += [request(deepseek_config(num_hidden_layers=6), quantization_config={"quant_method": "fp8"},
                     parallel=Parallel(pp_size=3, pp_rank=r)) for r in range(3)]
    plans = decided_plans(reqs * 2)     # the second time round every template is made already
    for plan in plans:
        assert answer_to_pb(plan) == plan_to_pb(plan)
        back = answer_to_pb(plan)
        assert all(d.decided_at == back.created_at for d in back.decisions)   # dated with its own plan
    # ranks of one stage share a template, yet each answer is its own
    a, b = plans[0], plans[1]
    assert a.decisions is b.decisions and answer_to_pb(a).plan_id != answer_to_pb(b).plan_id


def test_a_decision_with_its_own_time_keeps_it_and_plans_without_a_time_have_none():
    plan = decided_plans([request()])[0]
    key = sorted(plan.decisions)[2]
    earlier = T0 - dt.timedelta(days=1)
    decisions = {**plan.decisions, key: dataclasses.replace(plan.decisions[key], decided_at=earlier)}
    for variant in (dataclasses.replace(plan, decisions=decisions), dataclasses.replace(plan, created_at=None),
                    dataclasses.replace(plan, replayed=True),
                    dataclasses.replace(plan, history=(Decision("x", 1, "r", "rule", revision=1, decided_at=T0),))):
        assert answer_to_pb(variant) == plan_to_pb(variant)
    assert answer_to_pb(dataclasses.replace(plan, decisions=decisions)).decisions[2].decided_at.ToDatetime(
        tzinfo=dt.timezone.utc) == earlier


def test_one_config_text_is_parsed_once_and_a_bad_one_is_refused_every_time():
    cfg = deepseek_config()
    one, two = (request_from_pb(request_to_pb(request(cfg, request_id=f"r{i}"))) for i in range(2))
    assert one.config == cfg and one.config is two.config      # every rank shares the parsed config
    other = request_from_pb(request_to_pb(request(deepseek_config(hidden_size=128))))
    assert other.config is not one.config and other.config["hidden_size"] == 128
    msg = request_to_pb(request(cfg))
    for _ in range(2):
        msg.config_json = "[1, 2]"
        with pytest.raises(InvalidArgument) as err:
            request_from_pb(msg)
        assert err.value.field == "config_json"
    msg.config_json = json.dumps(cfg)
    assert request_from_pb(msg).config == cfg
