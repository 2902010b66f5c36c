"""layers/mamba2.py: the chunked scan is the token-by-token recurrence (any chunk, from any state); the decay, the
write and the skip each matter; the grouped gated norm normalises each group alone; the layer's state cache continues
a sequence exactly and rolls back as far as it keeps states."""

from __future__ import annotations

import math

import pytest
import torch

from loadplan.engine.layers.mamba2 import GroupedGatedRMSNorm, Mamba2Mixer, Mamba2Spec, ssd_chunked, ssd_steps


def _inputs(T: int, B: int = 2, H: int = 3, N: int = 8, P: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, T, N, generator=g), torch.randn(B, H, T, N, generator=g)
    v = torch.randn(B, H, T, P, generator=g) * 0.3
    decay = -torch.rand(B, H, T, generator=g) * 2            # log decays in (-2, 0]
    state = torch.randn(B, H, N, P, generator=g)
    return q, k, v, decay, state


@pytest.mark.parametrize("T, chunk", [(1, 4), (3, 4), (4, 4), (11, 4), (64, 64), (130, 64)])
def test_the_chunked_scan_is_the_token_by_token_recurrence(T, chunk):
    q, k, v, g, state = _inputs(T)
    want_y, want_states = ssd_steps(q, k, v, g, state)
    y, final = ssd_chunked(q, k, v, g, state, chunk=chunk)
    torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, want_states[-1], atol=1e-4, rtol=1e-4)


def test_the_recurrence_is_decay_then_write_then_read():
    """One step by hand: S1 = exp(g) S0 + k v^T, y = S1^T q."""
    q, k, v, g, state = _inputs(1, B=1, H=1)
    y, states = ssd_steps(q, k, v, g, state)
    s1 = g[0, 0, 0].exp() * state[0, 0] + k[0, 0, 0][:, None] * v[0, 0, 0][None, :]
    torch.testing.assert_close(states[0, 0, 0], s1)
    torch.testing.assert_close(y[0, 0, 0], s1.T @ q[0, 0, 0])


def test_the_grouped_norm_normalises_each_group_on_its_own():
    norm = GroupedGatedRMSNorm(8, groups=2, eps=0.0)
    y = torch.tensor([[1.0, 1, 1, 1, 10, 10, 10, 10]])
    gate = torch.full_like(y, 30.0)                          # silu(30) = 30 (to float32 precision)
    torch.testing.assert_close(norm(y, gate), torch.ones(1, 8))
    assert not torch.allclose(GroupedGatedRMSNorm(8, groups=1, eps=0.0)(y, gate), torch.ones(1, 8))


def _layer(seed: int = 0) -> Mamba2Mixer:
    torch.manual_seed(seed)
    layer = Mamba2Mixer(Mamba2Spec(hidden_size=16, n_heads=4, head_dim=8, n_groups=2, state_size=6, conv_kernel=4,
                                   conv_bias=True, proj_bias=False, rms_norm_eps=1e-6, time_step_limit=(0.0, math.inf)))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]) if p.dim() > 1 else torch.randn(p.shape) * 0.5)
    return layer


def _run(layer, x, start):
    return layer(x, None, None, torch.arange(start, start + x.shape[1]))


@torch.no_grad()
def test_a_cached_sequence_fed_in_pieces_is_the_whole_sequence():
    layer = _layer()
    x = torch.randn(1, 80, 16, generator=torch.Generator().manual_seed(1))
    whole = layer(x)                                                    # no cache: chunked, from position 0
    layer.setup_cache(1, 128, torch.float32, "cpu")
    pieces = torch.cat([_run(layer, x[:, :70], 0), _run(layer, x[:, 70:71], 70), _run(layer, x[:, 71:80], 71)],
                       dim=1)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_speculative_round_rolls_back_within_its_lookahead_and_no_further():
    """After a round that wrote positions 10-13 (4 = lookahead + 1), a forward may continue from any of them, or from
    10 itself, as if the rejected ones had never been written; from 9 it is refused."""
    x = torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(2))

    def after_the_round():
        layer = _layer()
        layer.setup_cache(1, 64, torch.float32, "cpu", lookahead=3)
        _run(layer, x[:, :10], 0)
        _run(layer, x[:, 10:14], 10)                                    # the round: 4 positions
        return layer

    for keep in (10, 11, 12, 13, 14):
        plain = _layer()
        plain.setup_cache(1, 64, torch.float32, "cpu", lookahead=3)
        want = _run(plain, x[:, :keep + 2], 0)[:, keep:]
        torch.testing.assert_close(_run(after_the_round(), x[:, keep:keep + 2], keep), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="no longer holds position 8"):
        _run(after_the_round(), x[:, 9:10], 9)


@torch.no_grad()
def test_its_time_step_limit_clamps_each_step():
    """A bound on dt changes the output; bounds that hold it where softplus puts it do not."""
    layer = _layer()
    x = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(3))
    free = layer(x)
    layer.time_step_limit = (0.0, 1e9)
    torch.testing.assert_close(layer(x), free)
    layer.time_step_limit = (0.0, 0.05)
    assert (layer(x) - free).abs().max() > 1e-3
