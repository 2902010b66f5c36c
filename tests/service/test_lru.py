"""`LruCache`: bounded, least recently used first out; `of` keys by the objects' identity."""

from __future__ import annotations

from loadplan.service.lru import LruCache


def test_the_least_recently_used_entry_goes_first():
    cache = LruCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1          # a is now the most recent
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3 and len(cache) == 2
    assert (cache.hits, cache.misses) == (3, 1)


def test_of_makes_once_per_object_and_never_answers_for_an_equal_other():
    cache = LruCache(8)
    made = []

    def make(tag):
        made.append(tag)
        return tag

    one, same_content = {"k": [1]}, {"k": [1]}
    assert cache.of((one,), lambda: make("one")) == "one"
    assert cache.of((one,), lambda: make("again")) == "one"
    assert cache.of((same_content,), lambda: make("other")) == "other"   # equal, yet another object
    assert cache.of((one,), lambda: make("v2"), "v2") == "v2"             # values are part of the key
    assert made == ["one", "other", "v2"]


def test_of_never_answers_for_an_object_that_reused_an_evicted_id():
    cache = LruCache(1)
    first = ["first"]
    cache.of((first,), lambda: "first")
    cache.of((["x"],), lambda: "x")          # evicts first's entry, which held it alive until now
    del first
    later = ["later"]                        # may get first's old id
    assert cache.of((later,), lambda: "later") == "later"
