"""The sliding-window ring cache (layers/kv_cache.WindowKVCache): what it hands the attention, what it keeps, and
the forward it refuses. Against transformers with the ring in use: the Mixtral and gpt-oss generation tests
(models/); with speculative rollbacks: test_speculative.py."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.layers.attention import AttentionSpec, GQAttention
from loadplan.engine.layers.kv_cache import KVCache, WindowKVCache


def _kv(positions, H=1, hd=2):
    """Keys whose values say their position: k[..., t, :] == position."""
    pos = torch.tensor(positions, dtype=torch.float32)
    return pos.view(1, 1, -1, 1).expand(1, H, -1, hd).clone()


def _step(cache, positions):
    k = _kv(positions)
    keys, values, key_pos = cache.update(torch.tensor(positions), k, k.clone())
    return keys, key_pos


def test_it_hands_over_the_earlier_positions_and_then_the_new_ones():
    cache = WindowKVCache(1, 1, 4, 2, torch.float32, "cpu", window=3)
    keys, key_pos = _step(cache, list(range(6)))                     # a prefill longer than the ring
    assert key_pos.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3, 4, 5]  # an empty ring, then the six
    assert sorted(cache.slot_pos.tolist()) == [2, 3, 4, 5]           # it keeps the last four
    keys, key_pos = _step(cache, [6])
    held = key_pos[:4].tolist()
    assert sorted(held) == [2, 3, 4, 5] and key_pos[4:].tolist() == [6]
    assert keys[0, 0, :, 0].tolist() == [float(p) for p in key_pos.tolist()]   # each key is its position's


def test_positions_a_rolled_back_round_wrote_are_handed_over_as_empty():
    cache = WindowKVCache(1, 1, 6, 2, torch.float32, "cpu", window=3)
    _step(cache, [0, 1, 2, 3])
    _step(cache, [4, 5])                                             # written ahead, then rolled back to 4
    _, key_pos = _step(cache, [4])
    assert sorted(p for p in key_pos[:6].tolist() if p >= 0) == [0, 1, 2, 3]   # not the old 4 and 5
    assert key_pos[6:].tolist() == [4]


def test_a_forward_whose_window_was_overwritten_is_refused():
    cache = WindowKVCache(1, 1, 3, 2, torch.float32, "cpu", window=3)
    _step(cache, [0, 1, 2, 3])
    _step(cache, [4, 5])                                             # two ahead: slots of 2 and 3 reused
    with pytest.raises(RuntimeError, match=r"no longer holds position 2, which position 4 attends to.*lookahead"):
        _step(cache, [4])
    roomy = WindowKVCache(1, 1, 3 + 2, 2, torch.float32, "cpu", window=3)      # window + lookahead
    for positions in ([0, 1, 2, 3], [4, 5], [4]):
        _step(roomy, positions)


def test_positions_must_follow_each_other():
    cache = WindowKVCache(1, 1, 4, 2, torch.float32, "cpu", window=2)
    with pytest.raises(ValueError, match="consecutive positions"):
        _step(cache, [0, 2])


@pytest.mark.parametrize("window, lookahead, max_len, kind, slots", [
    (4, 0, 32, WindowKVCache, 4), (4, 3, 32, WindowKVCache, 7), (4, 0, 4, KVCache, 4), (None, 5, 32, KVCache, 32)])
def test_a_window_layer_gets_a_ring_when_it_is_smaller(window, lookahead, max_len, kind, slots):
    attn = GQAttention(AttentionSpec(16, 2, 1, 8, sliding_window=window))
    cache = attn.setup_cache(1, max_len, torch.float32, "cpu", lookahead)
    assert type(cache) is kind and cache.k_cache.shape[2] == slots


def test_attention_through_the_ring_equals_attention_without_a_cache():
    """Prefill 5 tokens, then 6 decode steps, window 3, with and without sinks: every step's output equals the
    uncached forward over the whole sequence at that position."""
    torch.manual_seed(0)
    for sinks in (False, True):
        attn = GQAttention(AttentionSpec(16, 2, 1, 8, qkv_bias=True, o_bias=True, sliding_window=3, sinks=sinks))
        with torch.no_grad():
            for p in attn.parameters():
                p.copy_(torch.randn(p.shape) * 0.3)
        x = torch.randn(1, 11, 16)
        cos = torch.ones(11, 8)
        sin = torch.zeros(11, 8)
        with torch.no_grad():
            want = attn(x, cos, sin)
            attn.setup_cache(1, 11, torch.float32, "cpu")
            assert isinstance(attn.kv_cache, WindowKVCache) and attn.kv_cache.capacity == 3
            got = [attn(x[:, :5], cos[:5], sin[:5], torch.arange(5))]
            got += [attn(x[:, t:t + 1], cos[t:t + 1], sin[t:t + 1], torch.tensor([t])) for t in range(5, 11)]
        torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-5, rtol=1e-5)
