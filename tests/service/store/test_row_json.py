"""The JSON documents the PostgreSQL batch statements read (`_json_rows`, `_pg_from_json`) and
the decisions JSON remembered for the decisions the rules share (`_SharedDecisionsJson`)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadplan.plan import Decision, Runtime
from loadplan.service.store import repository as repo

AT = dt.datetime(2026, 11, 29, 12, 0, 0, 123456, tzinfo=dt.timezone.utc)


def _plan_row(**changes) -> tuple:
    values = {c: f"{c}-value" for c in repo._ROW_LAYOUTS["plans"]}
    values.update({c: i for i, c in enumerate(repo._ROW_LAYOUTS["plans"]) if c.endswith(("_size", "_rank"))})
    values.update(created_at=AT, quantization=None, config_json='{"hidden_size": 7168, "name": "caf\u00e9 \\"x\\""}',
                  decisions_json='[["k", [1, 2], "why", "rule", true]]')
    values.update(changes)
    return tuple(values[c] for c in repo._ROW_LAYOUTS["plans"])


def test_a_json_row_holds_every_value_where_the_statement_reads_it():
    rows = [_plan_row(), _plan_row(plan_id="other", quantization_config_json=None)]
    texts = repo._BatchTexts()
    doc = json.loads(repo._json_rows("plans", rows, texts))
    written = json.loads(texts.json())
    order = repo._JSON_ORDER["plans"]
    long = repo._LONG_TEXTS["plans"]
    assert sorted(order) == sorted(repo._ROW_LAYOUTS["plans"])
    for row, got in zip(rows, doc):
        expected = dict(zip(repo._ROW_LAYOUTS["plans"], row), created_at=AT.isoformat())
        read = {c: (None if v is None else written[v]) if c in long else v for c, v in zip(order, got)}
        assert read == expected
    # the statement reads each column at its place in the JSON row (a long text through `texts`)
    fields = repo._PG_INSERT_PLANS.split(" SELECT ")[1].split(" FROM jsonb_array_elements")[0]
    for column in repo.PLANS.columns:
        i = order.index(column.name)
        assert (repo._pg_text_at(i) if column.name in long else f"r->>{i}") in fields, column.name
    assert fields.count("r->>") == len(repo.PLANS.columns)


def test_a_statements_long_texts_are_written_once_each():
    texts = repo._BatchTexts()
    config, other = '{"a": "caf\u00e9 \\"x\\""}', "[1]"
    rows = [_plan_row(plan_id=f"p{i}", config_json=config if i % 2 else other) for i in range(6)]
    doc = json.loads(repo._json_rows("plans", rows, texts))
    pins = json.loads(repo._json_rows("deployment_pins", [("d", "target", config, "v1", "p0", AT)], texts))
    written = json.loads(texts.json())
    assert sorted(written) == sorted({config, other, rows[0][repo._ROW_LAYOUTS["plans"].index("runtime_json")],
                                      rows[0][repo._ROW_LAYOUTS["plans"].index("decisions_json")],
                                      rows[0][repo._ROW_LAYOUTS["plans"].index("quantization_config_json")]})
    at = repo._JSON_ORDER["plans"].index("config_json")
    assert [written[r[at]] for r in doc] == [other, config] * 3
    assert written[pins[0][-1]] == config                   # the pins' texts share the list


def test_long_texts_are_encoded_once_and_stay_exact():
    text = '{"a": "\\u00e9\\n", "b": "caf\u00e9"}' * 50
    first = repo._literal(text)
    assert json.loads(first) == text
    assert repo._literal(text) is first                      # remembered
    assert repo._literal("".join(text)) == first             # an equal text, another object
    assert repo._literal(None) == "null"


def _decisions(n: int = 3) -> dict[str, Decision]:
    return {f"k{i}": Decision(f"k{i}", [i, {"x": i}], f"reason {i}", "rule", i % 2 == 0) for i in range(n)}


def test_shared_decisions_are_encoded_once_as_the_stamped_ones_are():
    memo = repo._SharedDecisionsJson()
    unstamped = _decisions()
    stamped = {k: dataclasses.replace(d, decided_at=AT) for k, d in unstamped.items()}
    plan = type("P", (), {"decisions": stamped, "created_at": AT})()
    text = memo(unstamped)
    assert text == repo._decisions_json(plan)
    assert memo(dict(unstamped)) is text                     # the same objects in another mapping
    assert memo(_decisions()) == text and memo(_decisions()) is not text   # equal objects: encoded again


@pytest.mark.parametrize("change", [dict(revision=1), dict(decided_at=AT)], ids=["revised", "stamped"])
def test_unstamped_decisions_of_another_kind_are_refused(change):
    unstamped = _decisions()
    unstamped["k1"] = dataclasses.replace(unstamped["k1"], **change)
    with pytest.raises(ValueError, match="k1"):
        repo._SharedDecisionsJson()(unstamped)


def test_shared_decisions_views_are_remembered_by_identity():
    memo = repo._SharedDecisionsJson()
    view = MappingProxyType(_decisions())
    text = memo(view)
    assert text == memo(dict(view)) and memo(view) is text
    assert memo(MappingProxyType(_decisions())) == text      # another view of equal decisions: equal JSON


def test_deployment_inputs_json_is_remembered_for_the_rules_views_only():
    inputs = {"parallel.ep_size": 8, "runtime.enable_eplb": False, "quantization": None}
    view = MappingProxyType(dict(inputs))
    text = repo._inputs_json(view)
    assert json.loads(text) == inputs and text == repo._dumps(inputs)
    assert repo._inputs_json(view) is text                   # the same view: remembered
    # Equal as Python values is not equal as JSON: a view is never mistaken for an equal one.
    assert repo._inputs_json(MappingProxyType({"runtime.enable_eplb": 0})) == '{"runtime.enable_eplb": 0}'
    assert repo._inputs_json(MappingProxyType({"runtime.enable_eplb": False})) == '{"runtime.enable_eplb": false}'
    # A plain dict may change between plans: encoded every time.
    plain = dict(inputs)
    first = repo._inputs_json(plain)
    plain["parallel.ep_size"] = 16
    assert json.loads(repo._inputs_json(plain))["parallel.ep_size"] == 16 and json.loads(first)["parallel.ep_size"] == 8


def test_runtime_json_is_every_field_of_the_runtime():
    rt = Runtime(a2a_backend="deepep", enable_eplb=True, ep_num_redundant_experts=32)
    assert json.loads(repo._shared_runtime_json(rt)) == dataclasses.asdict(rt)
    assert repo._shared_runtime_json(rt) is repo._shared_runtime_json(rt)
    assert json.loads(repo._shared_runtime_json(Runtime())) == dataclasses.asdict(Runtime())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4), max_leaves=12)


@given(value=json_values)
def test_the_store_encoder_writes_what_json_writes(value):
    assert repo._dumps(value) == json.JSONEncoder(ensure_ascii=False).encode(value)
    assert repo._dumps_short([value, AT]) == json.JSONEncoder(ensure_ascii=False).encode([value, AT.isoformat()])


@pytest.mark.parametrize("value", [object(), {"k": {1, 2}}, [dt.date(2026, 1, 1)], b"bytes"])
def test_the_store_encoder_refuses_what_json_refuses(value):
    with pytest.raises(TypeError, match="not JSON serializable"):
        repo._dumps(value)
    with pytest.raises(TypeError, match="not JSON serializable"):
        repo._dumps_short([value])


def test_a_plan_made_like_another_has_the_json_row_it_would_have_from_scratch():
    from loadplan.plan import Parallel, ResolveRequest
    from loadplan.service.registry import Registry

    registry = Registry(object())
    config = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4, "n_routed_experts": 16,
              "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "name": "caf\u00e9 \"x\""}
    first = registry.new_plan(ResolveRequest("r0", "d0", parallel=Parallel(ep_size=2, ep_rank=1), host="h\u00e9",
                                             config=config, quantization_config={"quant_method": "fp8"}),
                              None, ('{"config": 1}', '{"quant_method": "fp8"}'))
    like = registry.new_plan_like(first, "r1", "d-1")
    plain = dataclasses.replace(like, like=None)
    texts, again = repo._BatchTexts(), repo._BatchTexts()
    assert repo._Item(like).plan_json(texts) == repo._Item(plain).plan_json(again)
    assert texts.json() == again.json()
    row = json.loads(repo._Item(like).plan_json(texts))
    assert row[:4] == [like.plan.plan_id, "r1", like.request_fingerprint, "d-1"]
