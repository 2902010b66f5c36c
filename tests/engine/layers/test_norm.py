"""RMSNorm, whole and split over tensor-parallel ranks (OLMoE's norm over a whole q / k projection)."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.layers.norm import RMSNorm


def _norm(dim, weight, **kw):
    n = RMSNorm(dim, 1e-5, **kw)
    n.weight.data.copy_(weight)
    return n


def test_a_norm_split_over_ranks_gives_each_rank_its_slice_of_the_whole():
    """Two ranks, each with half of a [3, 5, 16] projection: summing the squares over the ranks (a fake
    all-reduce here; gloo in tests/engine/parallel/test_tensor_parallel.py) gives the whole norm's halves.
    A rank that normalised its half alone would not."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 16, generator=g), torch.randn(16, generator=g)
    whole = _norm(16, w)(x)
    halves = x.chunk(2, dim=-1)
    squares = sum(h.float().pow(2).sum(-1, keepdim=True) for h in halves)       # what the all-reduce returns
    for rank, (h, wr) in enumerate(zip(halves, w.chunk(2))):
        split = _norm(8, wr, full_dim=16, reduce=lambda s: squares)(h)
        torch.testing.assert_close(split, whole[..., rank * 8:(rank + 1) * 8], rtol=0, atol=1e-6)
        alone = _norm(8, wr)(h)
        assert (alone - whole[..., rank * 8:(rank + 1) * 8]).abs().max() > 1e-2


def test_full_dim_and_reduce_go_together():
    with pytest.raises(ValueError, match="full_dim and reduce go together"):
        RMSNorm(8, full_dim=16)
