"""ResolveLoadPlan's shortcut for a request of a shape decided before (`request_shapes`): the same
answer, store hand-off and refusals as a resolve decided from scratch."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt

import pytest
from fake_store import FakeAsyncWriter, FakePlanStore
from sample_requests import deepseek_config, request

from loadplan.client.convert import plan_to_pb, request_to_pb
from loadplan.plan import Keys, Parallel, Runtime
from loadplan.service import registry as registry_module
from loadplan.service.registry import Registry
from loadplan.service.transport.request_shapes import RequestShapes, shape_key
from loadplan.service.transport.servicer import ModelRegistryServicer
from loadplan.v1 import registry_pb2 as pb

NOW = dt.datetime(2026, 11, 30, 12, 0, 0, 250, tzinfo=dt.timezone.utc)


def message(rank: int = 0, **kw) -> pb.ResolveLoadPlanRequest:
    """Rank `rank` of 8 (EP 4 x PP 2) of deployment dep-a, request r-1; `kw`: fields set on the message."""
    req = request(deepseek_config(), parallel=Parallel(ep_size=4, ep_rank=rank % 4, pp_size=2, pp_rank=rank // 4),
                  runtime=Runtime(a2a_backend="deepep", enable_eplb=True),
                  quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    msg = request_to_pb(req)
    msg.request_id, msg.deployment_id = "r-1", "dep-a"
    for name, value in kw.items():
        setattr(msg, name, value)
    return msg


class Refused(Exception):
    pass


class AbortContext:
    """What `_rpc` uses of a grpc.aio context: an abort is raised as `Refused(code, details, field)`."""

    metadata = ()

    def set_trailing_metadata(self, metadata):
        self.metadata = metadata

    async def abort(self, code, details):
        raise Refused(code, details, dict(self.metadata).get("loadplan-field"))


@pytest.fixture(params=["made by the handler", "made by the writer"])
def servicer_and_store(request):
    """servicer_and_store(clock) -> (servicer, store); each test that uses it runs twice: plans of a
    known shape made in the handler (a servicer without a writer), and made by the batch's writer
    (the server's way: `AsyncPlanWriter.save_made`)."""
    def make(clock=lambda: NOW) -> tuple[ModelRegistryServicer, FakePlanStore]:
        store = FakePlanStore()
        writer = FakeAsyncWriter(store) if request.param == "made by the writer" else None
        return ModelRegistryServicer(Registry(store, clock=clock), blocking=_inline,
                                     save_made=writer.save_made if writer else None), store
    return make


async def _inline(fn, *args):
    return fn(*args)


def resolve(servicer: ModelRegistryServicer, msg: pb.ResolveLoadPlanRequest) -> pb.LoadPlan:
    return pb.LoadPlan.FromString(asyncio.run(servicer.ResolveLoadPlan(msg, AbortContext())))


# --- the key -------------------------------------------------------------------------------

def test_the_key_is_the_request_but_its_ids_whatever_the_field_order():
    msg = message()
    key = shape_key(msg)
    assert msg == message()                                      # left as it was
    assert shape_key(message(request_id="r-2", deployment_id="dep-b")) == key
    # The same request with its fields written in reverse order (as another client may): one key.
    fields = [(f, getattr(msg, f.name)) for f in msg.DESCRIPTOR.fields
              if (msg.HasField(f.name) if f.type == f.TYPE_MESSAGE else getattr(msg, f.name))]
    reversed_bytes = b"".join(pb.ResolveLoadPlanRequest(**{f.name: value}).SerializeToString()
                              for f, value in reversed(fields))
    assert reversed_bytes != msg.SerializeToString()
    assert shape_key(pb.ResolveLoadPlanRequest.FromString(reversed_bytes)) == key


def _changes(msg: pb.ResolveLoadPlanRequest):
    """One changed copy of `msg` per field but the ids (from the descriptor: a field added later is covered)."""
    for f in msg.DESCRIPTOR.fields:
        if f.name in ("request_id", "deployment_id"):
            continue
        changed = pb.ResolveLoadPlanRequest()
        changed.CopyFrom(msg)
        if f.type == f.TYPE_MESSAGE:
            sub = getattr(changed, f.name)
            first = sub.DESCRIPTOR.fields[0]
            setattr(sub, first.name, getattr(sub, first.name) + (1 if first.type != first.TYPE_STRING else "x"))
        elif f.type == f.TYPE_ENUM:
            setattr(changed, f.name, getattr(msg, f.name) + 1)
        else:
            setattr(changed, f.name, getattr(msg, f.name) + " ")
        yield f.name, changed


def test_every_other_field_changes_the_key():
    msg = message()
    keys = {shape_key(msg)}
    for name, changed in _changes(msg):
        key = shape_key(changed)
        assert key not in keys, name
        keys.add(key)
    assert len(keys) == len(msg.DESCRIPTOR.fields) - 1


def test_shapes_are_bounded_by_count_and_by_bytes(servicer_and_store):
    servicer, _ = servicer_and_store()
    resolve(servicer, message())
    first = servicer.shapes.get(shape_key(message()))
    shapes = RequestShapes(maxsize=3, max_bytes=10_000)
    for i in range(3):
        shapes.remember(b"k%d" % i, first.first)
    assert len(shapes) == 3
    shapes.remember(b"k3", first.first)                          # full: forgotten, then this one
    assert len(shapes) == 1 and shapes.get(b"k3") is not None and shapes.get(b"k0") is None
    shapes.remember(b"x" * 9_999, first.first)                   # over the bytes: forgotten again
    assert len(shapes) == 1 and shapes.get(b"k3") is None
    shapes.remember(b"y" * 10_001, first.first)                  # larger than the bound: never held
    assert shapes.get(b"y" * 10_001) is None


# --- the shortcut ------------------------------------------------------------------------------

def test_a_known_shape_gets_the_answer_and_the_stored_plan_a_fresh_resolve_makes(servicer_and_store):
    servicer, store = servicer_and_store()
    resolve(servicer, message(3, request_id="r-first", deployment_id="dep-a"))
    assert len(servicer.shapes) == 1
    got = resolve(servicer, message(3, request_id="r-second", deployment_id="dep-b"))
    assert len(servicer.shapes) == 1                               # answered from its shape
    saved = store.plans[got.plan_id]
    assert got == plan_to_pb(saved)
    fresh_servicer, fresh_store = servicer_and_store()
    fresh = resolve(fresh_servicer, message(3, request_id="r-second", deployment_id="dep-b"))
    assert got.plan_id != fresh.plan_id
    got.plan_id = fresh.plan_id
    assert got == fresh                                             # every field, decisions and times included
    (kept,) = fresh_store.plans.values()
    assert dataclasses.replace(saved, plan_id=kept.plan_id) == kept


def test_a_known_shape_is_not_decided_again(monkeypatch, servicer_and_store):
    servicer, store = servicer_and_store()
    resolve(servicer, message(1, request_id="r-1"))

    def no_rules(*a, **kw):
        raise AssertionError("decided again")

    monkeypatch.setattr(registry_module, "resolve_decisions", no_rules)
    plans = [resolve(servicer, message(1, request_id=f"r-{i}", deployment_id=f"dep-{i}")) for i in range(2, 6)]
    assert len({p.plan_id for p in plans}) == 4
    assert [p.deployment_id for p in plans] == [f"dep-{i}" for i in range(2, 6)]
    with pytest.raises(Refused) as err:                             # another rank: another shape, decided
        resolve(servicer, message(2, request_id="r-9"))
    assert err.value.args[0].name == "INTERNAL"


def test_ranks_are_shapes_of_their_own(servicer_and_store):
    servicer, store = servicer_and_store()
    for rank in (0, 5):
        resolve(servicer, message(rank, request_id=f"r-a{rank}", deployment_id="dep-a"))
    plans = {rank: resolve(servicer, message(rank, request_id=f"r-b{rank}", deployment_id="dep-b")) for rank in (0, 5)}
    assert len(servicer.shapes) == 2
    layers = {rank: [d.value_json for d in p.decisions if d.key == Keys.PP_LAYER_RANGE] for rank, p in plans.items()}
    assert layers == {0: ["[0, 2]"], 5: ["[2, 4]"]}
    assert [(p.parallel.ep_rank, p.parallel.pp_rank) for p in plans.values()] == [(0, 0), (1, 1)]


def test_a_known_shape_still_checks_its_ids_and_saves_nothing_refused(servicer_and_store):
    servicer, store = servicer_and_store()
    resolve(servicer, message())
    for ids, field in (({"request_id": ""}, "request_id"), ({"request_id": "r 2"}, "request_id"),
                       ({"deployment_id": "-dep"}, "deployment_id")):
        with pytest.raises(Refused) as err:
            resolve(servicer, message(**{"request_id": "r-2", **ids}))
        assert err.value.args[0].name == "INVALID_ARGUMENT" and err.value.args[2] == field
    assert store.save_calls == ["r-1"]


def test_a_refused_shape_is_not_remembered(servicer_and_store):
    servicer, store = servicer_and_store()
    for request_id in ("r-1", "r-2"):
        with pytest.raises(Refused) as err:
            resolve(servicer, message(request_id=request_id, config_json='{"architectures": ["NoSuchModel"]}'))
        assert err.value.args[0].name == "NOT_FOUND" and err.value.args[2] == "config.architectures"
    assert len(servicer.shapes) == 0 and store.save_calls == []


def test_a_known_shape_replays_a_stored_request_id_and_refuses_another_request_under_it(servicer_and_store):
    servicer, store = servicer_and_store()
    first = resolve(servicer, message(request_id="r-1", deployment_id="dep-a"))
    resolve(servicer, message(request_id="r-2", deployment_id="dep-b"))
    again = resolve(servicer, message(request_id="r-1", deployment_id="dep-a"))
    assert again.replayed and again.plan_id == first.plan_id
    again.replayed = False
    assert again == first
    with pytest.raises(Refused) as err:                             # r-1 again, for another deployment
        resolve(servicer, message(request_id="r-1", deployment_id="dep-c"))
    assert err.value.args[0].name == "FAILED_PRECONDITION" and err.value.args[2] == "request_id"


def test_a_known_shape_is_checked_against_its_deployments_pin(servicer_and_store):
    servicer, store = servicer_and_store()
    resolve(servicer, message(0, request_id="r-0", deployment_id="dep-a"))
    other = message(1, request_id="r-1", deployment_id="dep-b", quantization_config_json="")
    resolve(servicer, other)                                        # a shape with no quantization config
    with pytest.raises(Refused) as err:                             # ... whose inputs differ from dep-a's pin
        resolve(servicer, message(1, request_id="r-2", deployment_id="dep-a", quantization_config_json=""))
    assert err.value.args[0].name == "FAILED_PRECONDITION"
    assert err.value.args[2] == "quantization"     # the first of the inputs that differ
