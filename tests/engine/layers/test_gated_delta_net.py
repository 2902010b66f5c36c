"""layers/gated_delta_net.py: the chunked delta rule is the token-by-token one; the state cache continues a
sequence exactly, rolls back as far as it keeps states (a speculative round), and refuses further."""

from __future__ import annotations

import math

import pytest
import torch

from loadplan.engine.layers.gated_delta_net import GatedDeltaNet, delta_rule_chunked, delta_rule_steps

from engine_helpers import delta_rule_inputs


@pytest.mark.parametrize("T, chunk", [(1, 4), (3, 4), (4, 4), (11, 4), (64, 64), (130, 64)])
def test_the_chunked_rule_is_the_token_by_token_rule(T, chunk):
    q, k, v, g, beta, state = delta_rule_inputs(T)
    want_o, want_states = delta_rule_steps(q, k, v, g, beta, state)
    o, final = delta_rule_chunked(q, k, v, g, beta, state, chunk=chunk)
    torch.testing.assert_close(o, want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, want_states[-1], atol=1e-4, rtol=1e-4)


def test_the_chunked_rule_is_exact_in_float64():
    """In float32 a chunk's triangular solve loses digits (1e-4 above); the algorithm itself is exact."""
    q, k, v, g, beta, state = (t.double() for t in delta_rule_inputs(130, seed=3))
    want_o, want_states = delta_rule_steps(q, k, v, g, beta, state)
    o, final = delta_rule_chunked(q, k, v, g, beta, state)
    torch.testing.assert_close(o, want_o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(final, want_states[-1], atol=1e-10, rtol=1e-10)


def test_the_decay_and_the_write_strength_matter():
    """Neither rule runs without its gates: no decay or a full write give other outputs."""
    q, k, v, g, beta, state = delta_rule_inputs(9)
    o, _ = delta_rule_steps(q, k, v, g, beta, state)
    assert (delta_rule_steps(q, k, v, torch.zeros_like(g), beta, state)[0] - o).abs().max() > 1e-2
    assert (delta_rule_steps(q, k, v, g, torch.ones_like(beta), state)[0] - o).abs().max() > 1e-2


def _layer(seed: int = 0) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(hidden_size=16, n_k_heads=2, n_v_heads=4, k_head_dim=8, v_head_dim=4, conv_kernel=4,
                          rms_norm_eps=1e-6)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]) if p.dim() > 1 else torch.randn(p.shape) * 0.5)
    return layer


def _run(layer, x, start):
    return layer(x, None, None, torch.arange(start, start + x.shape[1]))


@torch.no_grad()
def test_a_cached_sequence_fed_in_pieces_is_the_whole_sequence():
    layer = _layer()
    x = torch.randn(1, 13, 16, generator=torch.Generator().manual_seed(1))
    whole = layer(x)                                                    # no cache: from position 0
    layer.setup_cache(1, 64, torch.float32, "cpu")
    pieces = torch.cat([_run(layer, x[:, :9], 0), _run(layer, x[:, 9:10], 9), _run(layer, x[:, 10:13], 10)], dim=1)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_speculative_round_rolls_back_within_its_lookahead_and_no_further():
    """After a round that wrote positions 10-13 (4 = lookahead + 1), a forward may continue from any of them, or
    from 10 itself, as if the rejected ones had never been written; from 9 it is refused."""
    layer = _layer()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 14, 16, generator=g)
    other = torch.randn(1, 2, 16, generator=g)
    layer.setup_cache(1, 64, torch.float32, "cpu", lookahead=3)
    _run(layer, x[:, :10], 0)
    _run(layer, x[:, 10:14], 10)                                       # the round: 4 positions
    for keep in (10, 11, 12, 13, 14):                                  # accepted up to keep - 1
        got = _run(layer, other, keep)
        want = _fresh_copy(layer)(torch.cat([x[:, :keep], other], dim=1))[:, keep:]   # no cache: the whole
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"rollback to {keep}")
        if keep < 14:                                                  # the round's own positions again
            _run(layer, x[:, keep:14], keep)
    with pytest.raises(RuntimeError, match=r"no longer holds position 8.*lookahead"):
        _run(layer, other, 9)


def _fresh_copy(layer: GatedDeltaNet) -> GatedDeltaNet:
    fresh = _layer()
    fresh.load_state_dict(layer.state_dict())
    return fresh


def test_without_a_cache_it_runs_from_position_zero_only():
    layer = _layer()
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="without a state cache.*from position 0"):
        _run(layer, x, 5)
    layer.setup_cache(1, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="consecutive positions"):
        layer(x, None, None, torch.tensor([0, 2, 3]))


def test_value_heads_must_group_over_key_heads():
    with pytest.raises(ValueError, match="linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"):
        GatedDeltaNet(16, 2, 3, 8, 4, 4, 1e-6)


def test_a_forward_that_cannot_continue_from_the_cache_is_refused_naming_the_layer():
    """Every layer with a LinearStateCache reads it through continue_from: a cached forward needs its positions, and
    consecutive ones; without a cache a forward starts at position 0."""
    from loadplan.engine.layers.gated_delta_net import continue_from

    layer = _layer()
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="without a state cache a linear-attention layer runs a whole sequence"):
        layer(x, None, None, torch.arange(2, 5))
    layer.setup_cache(1, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="linear-attention layer's state cache is set up: pass input_pos"):
        layer(x)
    with pytest.raises(ValueError, match=r"a linear-attention layer takes consecutive positions, got \[0, 2, 3\]"):
        layer(x, None, None, torch.tensor([0, 2, 3]))
    assert continue_from(None, None, 3, 1, "any", lambda: ("prefix", "state")) == (0, "prefix", "state")
