"""`StampedDecisions`: a new plan's decisions, stamped with its creation time when first read.

The server encodes a plan from the rules' unstamped decisions and never reads the stamped
ones, so a resolve through the registry, the store and the answer's encoding copies none;
any reader sees exactly the dict it stands for."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import pickle

import pytest

from loadplan.plan import LoadPlan, ResolveRequest
from loadplan.service import registry as registry_module
from loadplan.service.registry import NewPlan, Registry, StampedDecisions
from loadplan.service.transport.plan_wire import plan_bytes

CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, "n_routed_experts": 16,
          "n_shared_experts": 1, "num_experts_per_tok": 4, "first_k_dense_replace": 1}
NOW = dt.datetime(2026, 11, 29, 10, 0, 0, 5, tzinfo=dt.timezone.utc)


class _Store:
    def __init__(self):
        self.saved: list[NewPlan] = []

    def save_plan(self, new: NewPlan) -> LoadPlan:
        self.saved.append(new)
        return new.plan


@pytest.fixture
def stamps(monkeypatch):
    """Counts the stamping of a plan's decisions."""
    calls = []
    real = registry_module._stamp

    def counting(decisions, at):
        calls.append(at)
        return real(decisions, at)

    monkeypatch.setattr(registry_module, "_stamp", counting)
    return calls


def _resolved(request_id: str = "r1"):
    registry = Registry(_Store(), clock=lambda: NOW)
    return registry.resolve_new(ResolveRequest(request_id, "d1", config=CONFIG), ("k", request_id[:0]))


def test_a_resolve_and_its_answer_copy_no_decision(stamps):
    got = _resolved()
    assert isinstance(got.plan.decisions, StampedDecisions)
    plan_bytes(got.plan, unstamped=got.new.unstamped)
    assert len(got.plan.decisions) == len(got.new.unstamped) and "moe.forward_path" in got.plan.decisions
    assert stamps == []
    # The first read stamps them all, once.
    assert got.plan.decisions["moe.forward_path"].decided_at == NOW
    assert [d.decided_at for d in got.plan.decisions.values()] == [NOW] * len(got.new.unstamped)
    assert stamps == [NOW]


def test_stamped_decisions_read_as_the_dict_they_stand_for(stamps):
    got = _resolved()
    decisions = got.plan.decisions
    expected = {k: dataclasses.replace(d, decided_at=NOW) for k, d in got.new.unstamped.items()}
    assert decisions == expected and expected == decisions and not decisions != expected
    assert dict(decisions) == expected and list(decisions) == list(expected)
    assert list(decisions.keys()) == list(expected) and list(decisions.items()) == list(expected.items())
    assert decisions.get("nope", 7) == 7 and decisions.get("moe.forward_path") == expected["moe.forward_path"]
    assert repr(decisions) == repr(expected)
    assert decisions == _resolved("r2").plan.decisions
    with pytest.raises(KeyError):
        decisions["nope"]
    with pytest.raises(TypeError):
        hash(decisions)


def test_stamped_decisions_copy_and_pickle_as_a_dict():
    plan = _resolved().plan
    for clone in (copy.deepcopy(plan.decisions), pickle.loads(pickle.dumps(plan.decisions))):
        assert type(clone) is dict and clone == dict(plan.decisions)
    assert pickle.loads(pickle.dumps(plan)) == plan
