"""Pipeline hand-off: tensors of shapes and dtypes the receiver does not know in advance."""

from __future__ import annotations

import torch

from loadplan.engine.parallel.launch import launch
from loadplan.engine.parallel.p2p import recv_tensor, recv_tensors, send_tensor, send_tensors


def _payloads():
    g = torch.Generator().manual_seed(0)
    prefill = [torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g).bfloat16(),
               torch.zeros(0, 4, dtype=torch.int64), torch.arange(5)]
    decode = torch.randn(1, 1, 4, generator=g)      # a later step: other shape, other rank count
    return prefill, decode


def _stage(rank, world_size):
    prefill, decode = _payloads()
    if rank == 0:
        send_tensors(prefill, dst=1)
        send_tensor(decode, dst=1)
        return recv_tensor(src=1)
    got = recv_tensors(src=0)
    got_decode = recv_tensor(src=0)
    send_tensor(got_decode * 2, dst=0)
    return got, got_decode


def test_hidden_states_cross_stages_intact():
    back, (got, got_decode) = launch(2, _stage, timeout_s=60)
    prefill, decode = _payloads()
    assert len(got) == len(prefill)
    for a, b in zip(got, prefill):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    assert torch.equal(got_decode, decode)
    assert torch.equal(back, decode * 2)
