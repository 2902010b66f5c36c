"""layers/kimi_delta_attention.py: the chunked rule with a decay per channel is the token-by-token one (which, per
channel, is decay then the delta rule's write then the read); each channel decays on its own."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.layers.gated_delta_net import delta_rule_steps
from loadplan.engine.layers.kimi_delta_attention import kda_chunked

from engine_helpers import delta_rule_inputs


def _inputs(T: int, B: int = 2, H: int = 3, d: int = 8, seed: int = 0):
    return delta_rule_inputs(T, B, H, d, d, seed, per_channel=True)


@pytest.mark.parametrize("T, chunk", [(1, 4), (3, 4), (4, 4), (11, 4), (64, 64), (130, 64)])
def test_the_chunked_rule_is_the_token_by_token_rule(T, chunk):
    q, k, v, g, beta, state = _inputs(T)
    want_o, want_states = delta_rule_steps(q, k, v, g, beta, state)
    o, final = kda_chunked(q, k, v, g, beta, state, chunk=chunk)
    torch.testing.assert_close(o, want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, want_states[-1], atol=1e-4, rtol=1e-4)


def test_the_chunked_rule_is_exact_in_float64():
    q, k, v, g, beta, state = (t.double() for t in _inputs(130, seed=3))
    want_o, want_states = delta_rule_steps(q, k, v, g, beta, state)
    o, final = kda_chunked(q, k, v, g, beta, state)
    torch.testing.assert_close(o, want_o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(final, want_states[-1], atol=1e-10, rtol=1e-10)


def test_one_step_by_hand_each_key_channel_decays_on_its_own():
    """S1 = diag(exp(g)) S0 + k (beta (v - (diag(exp(g)) S0)^T k))^T, o = S1^T q."""
    q, k, v, g, beta, state = _inputs(1, B=1, H=1, d=4, seed=5)
    o, states = delta_rule_steps(q, k, v, g, beta, state)
    decayed = g[0, 0, 0].exp()[:, None] * state[0, 0]
    s1 = decayed + torch.outer(k[0, 0, 0], beta[0, 0, 0] * (v[0, 0, 0] - decayed.T @ k[0, 0, 0]))
    torch.testing.assert_close(states[0, 0, 0], s1)
    torch.testing.assert_close(o[0, 0, 0], s1.T @ q[0, 0, 0])
    # one decay for the whole head (Gated DeltaNet's) is another rule
    assert (delta_rule_steps(q, k, v, g.mean(-1), beta, state)[0] - o).abs().max() > 1e-3
