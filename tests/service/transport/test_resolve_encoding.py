"""ResolveLoadPlan's shortcuts in the transport: config documents parsed once per text and
shared between requests, the texts the store is handed, and the answer written as bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

import pytest
from fake_store import FakeAsyncWriter
from sample_requests import deepseek_config, request

from loadplan.client.convert import config_to_json, plan_to_pb, quantization_config_to_json, request_to_pb
from loadplan.plan import Parallel
from loadplan.service.errors import InvalidArgument
from loadplan.service.registry import NewPlan, Registry
from loadplan.service.transport import convert
from loadplan.service.transport.servicer import ModelRegistryServicer
from loadplan.v1 import registry_pb2 as pb

# Formatted unlike json.dumps (spaces, order kept): the store's text is a re-encoding.
CONFIG_TEXT = json.dumps(deepseek_config(), indent=1)
QCONFIG_TEXT = '{"weight_block_size":[128,128],"quant_method":"fp8"}'


def message(rank: int = 0, deployment: str = "dep-a", **kw) -> pb.ResolveLoadPlanRequest:
    msg = request_to_pb(request(deployment_id=deployment, parallel=Parallel(ep_size=8, ep_rank=rank)))
    msg.config_json, msg.quantization_config_json = CONFIG_TEXT, QCONFIG_TEXT
    for name, value in kw.items():
        setattr(msg, name, value)
    return msg


def resolve(servicer: ModelRegistryServicer, msg: pb.ResolveLoadPlanRequest):
    """One ResolveLoadPlan on an event loop of its own (no context: nothing is refused here)."""
    return asyncio.run(servicer.ResolveLoadPlan(msg, None))


class RecordingStore:
    def __init__(self):
        self.saved: list[NewPlan] = []
        self.by_request = {}

    def save_plan(self, new: NewPlan):
        self.saved.append(new)
        stored = self.by_request.setdefault(new.plan.request.request_id, new.plan)
        return stored if stored is new.plan else dataclasses.replace(stored, replayed=True)


def test_ranks_share_one_parsed_document_that_stays_as_parsed():
    store = RecordingStore()
    servicer = ModelRegistryServicer(Registry(store))
    for rank in range(8):
        resolve(servicer, message(rank))
    configs = [new.plan.request.config for new in store.saved]
    assert all(c is configs[0] for c in configs)
    assert configs[0] == json.loads(CONFIG_TEXT)          # nothing on the way changed it
    assert store.saved[0].plan.request.quantization_config == json.loads(QCONFIG_TEXT)


def test_the_store_gets_the_config_texts_plan_to_pb_writes():
    store = RecordingStore()
    servicer = ModelRegistryServicer(Registry(store))
    resolve(servicer, message())
    resolve(servicer, message(quantization_config_json=""))
    with_q, without_q = store.saved
    req = with_q.plan.request
    assert with_q.config_json == config_to_json(req.config) != CONFIG_TEXT
    assert with_q.quantization_config_json == quantization_config_to_json(req.quantization_config)
    assert without_q.plan.request.quantization_config is None
    assert without_q.quantization_config_json is None      # no quantization config: the store writes NULL


def test_the_answer_is_the_plan_as_plan_to_pb_writes_it_fresh_or_replayed():
    store = RecordingStore()
    servicer = ModelRegistryServicer(Registry(store))
    msg = message(request_id=f"r-{uuid.uuid4().hex}")
    fresh = resolve(servicer, msg)
    assert isinstance(fresh, bytes)   # sent as it is (servicer.add_to_server)
    assert pb.LoadPlan.FromString(fresh) == plan_to_pb(store.saved[0].plan)
    again = pb.LoadPlan.FromString(resolve(servicer, msg))
    assert again == plan_to_pb(dataclasses.replace(store.saved[0].plan, replayed=True)) and again.replayed


def test_refusals_are_not_remembered():
    for _ in range(2):
        with pytest.raises(InvalidArgument) as err:
            convert.request_from_pb(message(config_json="{not json"))
        assert err.value.field == "config_json"
        with pytest.raises(InvalidArgument) as err:
            convert.request_from_pb(message(config_json="[1, 2]"))
        assert err.value.field == "config_json"
    deep = '{"a": ' * 70 + "1" + "}" * 70
    with pytest.raises(InvalidArgument, match="nested deeper"):
        convert.request_from_pb(message(quantization_config_json=deep))
    assert "{not json" not in convert._DOCUMENTS and deep not in convert._DOCUMENTS


def test_the_documents_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(convert, "DOCUMENTS_SIZE", 3)
    monkeypatch.setattr(convert, "_DOCUMENTS", {})
    monkeypatch.setattr(convert, "_documents_chars", 0)
    texts = [json.dumps({**deepseek_config(), "n": i}) for i in range(5)]
    for text in texts:
        assert convert.request_from_pb(message(config_json=text, quantization_config_json="")).config == \
            json.loads(text)
    assert list(convert._DOCUMENTS) == texts[-3:]   # the oldest forgotten first
    assert convert._documents_chars == sum(map(len, convert._DOCUMENTS))
    monkeypatch.setattr(convert, "DOCUMENTS_CHARS", len(texts[0]) - 1)   # too long to remember: parsed each time
    big = json.dumps({**deepseek_config(), "big": "x" * len(texts[0])})
    assert convert.request_from_pb(message(config_json=big)).config["big"] == "x" * len(texts[0])
    assert big not in convert._DOCUMENTS


class AbortContext:
    """What `_rpc` uses of a grpc.aio context: the status it aborts with is raised."""

    def set_trailing_metadata(self, metadata):
        self.metadata = metadata

    async def abort(self, code, details):
        raise AssertionError(f"aborted {code}: {details}")


def counting_plan_bytes(monkeypatch) -> list:
    """plan_wire.plan_bytes, counting its calls in the list returned."""
    from loadplan.service.transport import plan_wire

    calls = []
    real = plan_wire.plan_bytes
    monkeypatch.setattr(plan_wire, "plan_bytes", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def with_writer(store) -> ModelRegistryServicer:
    """A servicer as the server makes it: plans saved, and their answers derived, by an async
    writer's batches (`AsyncPlanWriter.save_made`; the fake's batch yields to the loop once, as
    the database's round trip does, before the store saves its plans)."""
    store.wait_timeout_s = None
    writer = FakeAsyncWriter(store)
    return ModelRegistryServicer(Registry(store), save_made=writer.save_made)


def test_the_answer_is_encoded_while_the_writer_saves_the_plan(monkeypatch):
    """A new plan's answer is written while its batch waits on the database (not after the commit,
    on the caller's latency), once, and is the saved plan's."""
    calls = counting_plan_bytes(monkeypatch)
    store = RecordingStore()
    encoded_when_saved = []
    save_plan = store.save_plan
    store.save_plan = lambda new: encoded_when_saved.append(len(calls)) or save_plan(new)
    answer = resolve(with_writer(store), message())
    assert encoded_when_saved == [1] and len(calls) == 1
    assert pb.LoadPlan.FromString(answer) == plan_to_pb(store.saved[0].plan)


def test_a_replayed_plan_is_answered_not_the_one_encoded_early():
    stored = RecordingStore()
    first = pb.LoadPlan.FromString(resolve(ModelRegistryServicer(Registry(stored)), message(request_id="r-1")))
    again = pb.LoadPlan.FromString(resolve(with_writer(stored), message(request_id="r-1")))
    assert again.replayed and again.plan_id == first.plan_id != stored.saved[1].plan.plan_id
    again.replayed = False
    assert again == first


def test_an_early_encoding_that_fails_is_reported_as_the_callers_error(monkeypatch):
    from loadplan.service.transport import plan_wire

    def broken(*a, **kw):
        raise RuntimeError("encoder bug")

    monkeypatch.setattr(plan_wire, "plan_bytes", broken)
    store = RecordingStore()
    with pytest.raises(AssertionError, match=r"INTERNAL: internal error \(incident"):
        asyncio.run(with_writer(store).ResolveLoadPlan(message(), AbortContext()))
    assert len(store.saved) == 1          # saved all the same: a retry with its request id replays it
