"""`service.memo`: bounded memos by value and by identity."""

from __future__ import annotations

from types import MappingProxyType

from loadplan.service.memo import ByIdentity, Memo, is_shared_view


def test_a_memo_computes_each_key_once_and_is_bounded():
    calls = []
    memo = Memo(lambda k: calls.append(k) or f"<{k}>", maxsize=3)
    assert [memo(k) for k in "abab"] == ["<a>", "<b>", "<a>", "<b>"]
    assert calls == ["a", "b"]
    for k in "cdefg":
        memo(k)
    assert len(memo.memo) <= 3
    assert memo("g") == "<g>" and calls[-1] == "g"


def test_by_identity_tells_equal_objects_apart_and_keeps_what_it_remembers():
    calls = []
    memo = ByIdentity(lambda obj: calls.append(obj) or repr(dict(obj)))
    a, b = MappingProxyType({"x": True}), MappingProxyType({"x": 1})   # equal as values (True == 1)
    assert a == b
    assert memo(a) == "{'x': True}" and memo(b) == "{'x': 1}"
    assert memo(a) == "{'x': True}" and len(calls) == 2
    # An entry holds its object: a freed object's id cannot come back as another's hit.
    for _ in range(100):
        memo(MappingProxyType({"x": 2}))
    assert all(hit[0] is not None for hit in memo.memo.values())
    assert len(calls) == 102


def test_by_identity_is_bounded():
    memo = ByIdentity(lambda obj: id(obj), maxsize=5)
    keep = [object() for _ in range(12)]
    for obj in keep:
        assert memo(obj) == id(obj)
    assert len(memo.memo) <= 5


def test_only_read_only_views_count_as_shared():
    assert is_shared_view(MappingProxyType({"a": 1}))
    for mapping in ({"a": 1}, dict(MappingProxyType({"a": 1}))):
        assert not is_shared_view(mapping)
