"""Bad input (issue 6): property-based ResolveLoadPlan requests and config JSON.

Whatever the request (ids with odd characters, huge or negative numbers, unknown
roles/backends/devices/runners) and whatever the config (wrong types in every field
the families read, huge numbers, floats for ints, NaN/Infinity, deep nesting,
unicode, truncated text): the registry never crashes and never answers UNKNOWN or
INTERNAL; a refusal is INVALID_ARGUMENT / NOT_FOUND / FAILED_PRECONDITION with a
message, and leaves no row. Oversized messages are refused (RESOURCE_EXHAUSTED).

Two entrances, each on SQLite and PostgreSQL (a real store: what the database
refuses matters): the gRPC server in-process, and `Registry.resolve` directly (which
takes Python values the wire cannot carry: unbounded ints, lone surrogates).
"""

from __future__ import annotations

import json
import math
import uuid

import grpc
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from loadplan.client import convert
from loadplan.plan import Parallel, ResolveRequest, Runtime
from loadplan.errors import FailedPrecondition, InvalidArgument, NotFound, RegistryError
from loadplan.service.registry import Registry
from loadplan.service.rules.backends import BACKENDS
from loadplan.service.server import DEFAULT_MAX_RECEIVE_BYTES, RegistryServer, ServerOptions
from loadplan.service.store.db import make_engine
from loadplan.service.store.repository import SqlPlanStore
from loadplan.v1 import registry_pb2 as pb
from loadplan.v1 import registry_pb2_grpc as pb_grpc

REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}
FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])

# --- configs ---------------------------------------------------------------------

_DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4, "n_routed_experts": 256,
             "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1}
BASE_CONFIGS = [
    _DEEPSEEK,
    dict(_DEEPSEEK, architectures=["DeepseekV2ForCausalLM"], n_routed_experts=64),
    dict(_DEEPSEEK, architectures=["DeepseekV3ForCausalLMNextN"], num_nextn_predict_layers=1),
    dict(_DEEPSEEK, architectures=["Glm4MoeForCausalLM"], n_routed_experts=128),
    {"architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
     "shared_expert_intermediate_size": 32, "moe_intermediate_size": 32},
    {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
     "decoder_sparse_step": 1, "mlp_only_layers": []},
    {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": _DEEPSEEK},
]
# Every field a family, a wrapper or the quantization reads.
READ_FIELDS = ["architectures", "num_hidden_layers", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
               "first_k_dense_replace", "moe_layer_freq", "num_nextn_predict_layers", "num_experts",
               "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "moe_intermediate_size",
               "num_local_experts", "quantization_config", "text_config"]
QUANT_FIELDS = ["quant_method", "quant_algo", "exclude_modules", "ignore", "modules_to_not_convert",
                "ignored_layers"]

# Unicode, with the characters databases and encoders trip on: NUL, controls, surrogates
# (the direct entrance only: the wire carries UTF-8), right-to-left, emoji.
odd_text = st.one_of(st.text(max_size=12), st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,20}", fullmatch=True),
                     st.text(st.sampled_from("\x00\x01\n\t\u202e\ufeff\U0001f600é漢'\"\\%_"), max_size=8),
                     st.sampled_from(["", " ", "x" * 300, "NaN", "../../etc", "'; DROP TABLE plans;--",
                                      "\ud800", "a\udfffb", "y" * 100_000]))
big_ints = st.one_of(st.integers(-3, 512), st.integers(),
                     st.sampled_from([2**31 - 1, 2**31, -2**31, 2**63, -2**63 - 1, 10**30, 10**300]))
json_scalars = st.one_of(st.none(), st.booleans(), big_ints, st.floats(allow_nan=True, allow_infinity=True),
                         odd_text)
json_values = st.recursive(json_scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                                st.dictionaries(odd_text, kids, max_size=4)),
                           max_leaves=12)


def _nested(depth: int):
    value: object = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


field_values = st.one_of(json_values, big_ints, st.floats(min_value=1, max_value=512).map(float),
                         st.sampled_from([8.0, 256.0, "8", True, False, None, [], {}, [8], -1, 0, 2**31, 10**30,
                                          math.nan, math.inf, -math.inf, ["DeepseekV3ForCausalLM", 1],
                                          ["NoSuchModel"], [""], "DeepseekV3ForCausalLM", 10**6, 5000]),
                         st.integers(1, 80).map(_nested))


@st.composite
def configs(draw):
    cfg = json.loads(json.dumps(draw(st.sampled_from(BASE_CONFIGS))))
    for _ in range(draw(st.integers(0, 3))):
        target = cfg["text_config"] if "text_config" in cfg and isinstance(cfg["text_config"], dict) \
            and draw(st.booleans()) else cfg
        op = draw(st.sampled_from(["set", "set", "drop", "quant", "junk"]))
        if op == "set":
            target[draw(st.sampled_from(READ_FIELDS))] = draw(field_values)
        elif op == "drop":
            if target:
                target.pop(draw(st.sampled_from(sorted(target))), None)
        elif op == "quant":
            q = target.setdefault("quantization_config", {})
            if isinstance(q, dict):
                q[draw(st.sampled_from(QUANT_FIELDS))] = draw(field_values)
        else:
            target[draw(odd_text)] = draw(json_values)
    if draw(st.integers(0, 9)) == 0:
        return draw(st.dictionaries(odd_text, json_values, max_size=6))
    return cfg


names = lambda known: st.one_of(st.sampled_from(known), odd_text)   # noqa: E731
RUNTIME_FIELDS = {
    "a2a_backend": names(sorted(BACKENDS)),
    "device": names(["cpu", "cuda:9.0", "cuda:7.0", "hip:9.4", "musa:3.1", "cuda", "cpu:1.0", " CPU ", "tpu:1.0"]),
    "engine": names(["", "loadplan", "sglang", "vllm"]),
    "engine_version": names(["", "0.1.0", "0.5.23", "0.32.0"]),
    "moe_runner_backend": names(["", "auto", "triton", "flashinfer_trtllm"]),
    "enable_sbo": st.booleans(), "enable_tbo": st.booleans(),
    "disable_shared_experts_fusion": st.booleans(), "enforce_shared_experts_fusion": st.booleans(),
    "enable_eplb": st.booleans(), "ep_num_redundant_experts": st.one_of(st.integers(0, 8), big_ints),
}
PARALLEL_FIELDS = [f"{a}_{k}" for a in ("tp", "ep", "pp", "dp") for k in ("size", "rank")]
small_or_big = st.one_of(st.integers(-1, 4), big_ints)
ids = st.one_of(st.uuids().map(lambda u: f"fz-{u.hex}"), odd_text)


@st.composite
def requests(draw, *, wire: bool):
    """A valid request with a few of its fields (or none) replaced by anything: most
    examples get past the first check, so every later one is exercised too."""
    fields = dict(request_id=f"fz-{draw(st.uuids()).hex}", deployment_id=f"fz-{draw(st.uuids()).hex[:8]}",
                  role="target", parallel={}, host="node-0", config=draw(configs()), quantization_config=None,
                  quantization=None, runtime={})
    for _ in range(draw(st.integers(0, 3))):
        what = draw(st.sampled_from(["request_id", "deployment_id", "role", "parallel", "parallel", "host",
                                     "quantization_config", "quantization", "runtime", "runtime", "runtime"]))
        if what in ("request_id", "deployment_id"):
            fields[what] = draw(ids)
        elif what == "role":
            fields[what] = draw(st.sampled_from(["target", "speculative"]) if wire else
                                names(["target", "speculative"]))
        elif what == "parallel":
            fields["parallel"][draw(st.sampled_from(PARALLEL_FIELDS))] = draw(small_or_big)
        elif what == "host":
            fields[what] = draw(odd_text)
        elif what == "quantization_config":
            fields[what] = draw(st.dictionaries(st.sampled_from(QUANT_FIELDS), field_values, max_size=3))
        elif what == "quantization":
            fields[what] = draw(names(["fp8", "quark", "w4afp8", "wint4a16", "modelopt_fp4", "awq"]))
        else:
            name = draw(st.sampled_from(sorted(RUNTIME_FIELDS)))
            fields["runtime"][name] = draw(RUNTIME_FIELDS[name])
    fields["parallel"] = Parallel(**fields["parallel"])
    fields["runtime"] = Runtime(**fields["runtime"])
    return ResolveRequest(**fields)


# --- config text the wire can carry but json cannot parse nicely ------------------------

@st.composite
def config_texts(draw):
    text = json.dumps(draw(configs()))
    kind = draw(st.sampled_from(["as is", "truncated", "literal", "deep", "not an object", "garbage"]))
    if kind == "truncated":
        return text[:draw(st.integers(0, max(0, len(text) - 1)))]
    if kind == "literal":
        lit = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 5000, "1.5",
                                    "12345678901234567890123456789", "\"\\u0000\"", "\"\\ud800\"", "\"\\udfff\""]))
        if draw(st.booleans()) and "4" in text:
            return text.replace("4", lit, 1)            # where a number is read
        return text[:-1] + ', "extra": ' + lit + "}"     # where nothing reads it, but it is stored
    if kind == "deep":
        n = draw(st.sampled_from([63, 65, 500, 5000, 200000]))
        return '{"architectures": ["DeepseekV3ForCausalLM"], "x": ' + "[" * n + "]" * n + "}"
    if kind == "not an object":
        return draw(st.sampled_from(["[]", "null", "1", "\"x\"", "true", "[{}]"]))
    if kind == "garbage":
        return draw(st.text(max_size=40))
    return text


# --- fixtures -------------------------------------------------------------------------

@pytest.fixture(params=["sqlite", "postgres"])
def engine(request):
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_db")
    eng = make_engine(url)
    yield eng
    eng.dispose()


def rows(engine) -> tuple[int, int, int]:
    with engine.connect() as c:
        return tuple(c.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one()
                     for t in ("plans", "decisions", "deployment_pins"))


@pytest.fixture
def stub(engine):
    server = RegistryServer(SqlPlanStore(engine), ServerOptions(listen="127.0.0.1:0", max_workers=4,
                                                                 readiness_interval_s=3600)).start()
    channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)])
    try:
        yield pb_grpc.ModelRegistryStub(channel)
    finally:
        channel.close()
        server.stop(grace=0.5)


def _encode(req: ResolveRequest) -> pb.ResolveLoadPlanRequest | None:
    """The wire message, or None when protobuf itself cannot carry the values (int32, UTF-8)."""
    try:
        msg = convert.request_to_pb(req)
        msg.SerializeToString()
        return msg
    except (ValueError, TypeError, convert.WireError):
        return None


def _check_call(stub, engine, msg) -> str:
    before = rows(engine)
    try:
        reply = stub.ResolveLoadPlan(msg, timeout=30)
    except grpc.RpcError as e:
        assert e.code() in REFUSALS, f"{e.code().name}: {e.details()}"
        assert (e.details() or "").strip(), f"{e.code().name} without a message"
        assert rows(engine) == before, f"refused ({e.code().name}: {e.details()}) but rows were written"
        return e.code().name
    assert reply.plan_id and reply.request_id == msg.request_id
    after = rows(engine)
    if reply.replayed:
        assert after == before
    else:
        # One plan row holding all its decisions (decisions rows are for appended revisions).
        assert after[0] == before[0] + 1 and after[1] == before[1]
        with engine.connect() as c:
            stored = c.execute(sa.text("SELECT decisions_json FROM plans WHERE plan_id = :p"),
                               {"p": reply.plan_id}).scalar_one()
        assert sorted(d[0] for d in json.loads(stored)) == sorted(d.key for d in reply.decisions)
    return "OK"


# --- the properties -------------------------------------------------------------------

@FUZZ
@given(req=requests(wire=True))
def test_resolve_over_grpc_answers_a_status_never_a_crash(stub, engine, req):
    msg = _encode(req)
    assume(msg is not None)
    event(_check_call(stub, engine, msg))


@FUZZ
@given(text=config_texts(), qtext=st.one_of(st.just(""), config_texts()),
       role=st.one_of(st.sampled_from([pb.ROLE_TARGET, pb.ROLE_SPECULATIVE]), st.integers(-2**31, 2**31 - 1)))
def test_config_json_text_over_grpc(stub, engine, text, qtext, role):
    """The raw wire: config text as sent (truncated, NaN, deep, ...), any role number."""
    msg = pb.ResolveLoadPlanRequest(request_id=f"fz-{uuid.uuid4().hex}", deployment_id=f"fz-{uuid.uuid4().hex[:8]}",
                                    config_json=text, quantization_config_json=qtext, role=role)
    event(_check_call(stub, engine, msg))


@FUZZ
@given(req=requests(wire=False))
def test_registry_resolve_directly(engine, req):
    """Python values the wire cannot carry: unbounded ints, lone surrogates, any role string."""
    registry = Registry(SqlPlanStore(engine))
    before = rows(engine)
    try:
        plan = registry.resolve(req)
    except (InvalidArgument, NotFound, FailedPrecondition) as e:
        assert str(e).strip()
        event(type(e).__name__)
        assert rows(engine) == before, f"refused ({type(e).__name__}: {e}) but rows were written"
        return
    except RegistryError as e:
        pytest.fail(f"{type(e).__name__} ({e.code}) is not a request refusal: {e}")
    event("OK")
    assert plan.request.request_id == req.request_id
    assert rows(engine)[0] == before[0] + (0 if plan.replayed else 1)


def test_oversized_message_is_refused_and_leaves_no_row(stub, engine):
    before = rows(engine)
    padding = "x" * (DEFAULT_MAX_RECEIVE_BYTES + 1024)
    cfg = dict(_DEEPSEEK, padding=padding)
    msg = convert.request_to_pb(ResolveRequest(request_id=f"fz-{uuid.uuid4().hex}", deployment_id="fz-big",
                                               config=cfg))
    with pytest.raises(grpc.RpcError) as info:
        stub.ResolveLoadPlan(msg, timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert rows(engine) == before
    # Just under the limit is an ordinary request.
    cfg["padding"] = "x" * (DEFAULT_MAX_RECEIVE_BYTES - 64 * 1024)
    msg = convert.request_to_pb(ResolveRequest(request_id=f"fz-{uuid.uuid4().hex}", deployment_id="fz-big2",
                                               config=cfg))
    assert stub.ResolveLoadPlan(msg, timeout=30).plan_id
    assert rows(engine)[0] == before[0] + 1


# --- what the fuzzing found, pinned as examples ------------------------------------------
# Each reached the database (or the HTTP/2 trailers) and came back INTERNAL, UNKNOWN or
# RESOURCE_EXHAUSTED, or held the registry for seconds; each must be a refusal by name.

def _wire(config=None, **fields) -> pb.ResolveLoadPlanRequest:
    msg = pb.ResolveLoadPlanRequest(request_id=f"fz-{uuid.uuid4().hex}", deployment_id=f"fz-{uuid.uuid4().hex[:8]}",
                                    **fields)
    msg.config_json = config if isinstance(config, str) else json.dumps(config or _DEEPSEEK)
    return msg


KNOWN_BAD = {
    # PostgreSQL text refuses NUL: DataError -> INTERNAL
    "NUL in host": (_wire(host="node\x000"), "host"),
    "NUL in quantization": (_wire(quantization="fp\x008"), "quantization"),
    # a VARCHAR(128) column: DataError -> INTERNAL
    "quantization name too long": (_wire(quantization="q" * 300), "quantization"),
    "quant_method too long": (_wire(dict(_DEEPSEEK, quantization_config={"quant_method": "m" * 300})),
                              "quantization_config.quant_method"),
    # a lone surrogate escape is valid JSON text but no UTF-8 exists for it: UnicodeEncodeError -> INTERNAL
    "unpaired surrogate in a config value": (_wire(json.dumps(_DEEPSEEK)[:-1] + ', "x": "\\ud800"}'), "config.x"),
    "unpaired surrogate in a key": (_wire(json.dumps(_DEEPSEEK)[:-1] + ', "\\udfff": 1}'), "config.<key>"),
    "unpaired surrogate in quantization_config": (_wire(quantization_config_json='{"quant_method": "\\ud800"}'),
                                                  "quantization_config.quant_method"),
    # 10**9 layers were enumerated: minutes and gigabytes for one request
    "absurd layer count": (_wire(dict(_DEEPSEEK, num_hidden_layers=10**9)), "config.num_hidden_layers"),
    # the refusal quoted the whole 100 kB value: trailers over 16 KiB -> RESOURCE_EXHAUSTED, reason lost
    "huge value in a wrong-typed field": (_wire(dict(_DEEPSEEK, num_hidden_layers="x" * 100_000)),
                                          "config.num_hidden_layers"),
    "huge unknown entry class": (_wire(dict(_DEEPSEEK, architectures=["X" * 100_000])), "config.architectures"),
    # a control character in the blamed field's path made the metadata invalid -> INTERNAL
    "control character in a key": (_wire(quantization_config_json='{"\\u001f": "\\ud800"}'),
                                   "quantization_config.\\x1f"),
}


@pytest.mark.parametrize("case", sorted(KNOWN_BAD))
def test_known_bad_inputs_are_refused_by_name(stub, engine, case):
    msg, field = KNOWN_BAD[case]
    before = rows(engine)
    with pytest.raises(grpc.RpcError) as info:
        stub.ResolveLoadPlan(msg, timeout=30)
    err = info.value
    assert err.code() in REFUSALS, f"{err.code().name}: {err.details()}"
    assert len(err.details()) <= 4096
    blamed = dict(err.trailing_metadata() or ()).get("loadplan-field")
    assert blamed == field, (blamed, err.details()[:200])
    assert rows(engine) == before


@pytest.mark.parametrize("value", [2**31, 2**40, 10**30])
def test_parallel_sizes_beyond_int32_are_refused_directly(engine, value):
    """The wire cannot carry them; a direct caller can, and PostgreSQL's INTEGER refused them (INTERNAL)."""
    before = rows(engine)
    with pytest.raises(InvalidArgument) as info:
        Registry(SqlPlanStore(engine)).resolve(ResolveRequest(request_id=f"fz-{uuid.uuid4().hex}",
                                                              deployment_id="fz-int", config=_DEEPSEEK,
                                                              parallel=Parallel(tp_size=value)))
    assert info.value.field == "parallel.tp_size"
    assert rows(engine) == before
