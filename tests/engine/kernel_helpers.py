"""Helpers of the expert kernel tests (test_expert_kernel.py, test_expert_native.py): the float64
reference of the grouped expert MLP (a loop over tokens and slots, nothing shared with the code
under test) and a dispatch mode that counts the torch ops a call runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


def make_experts(S, T, seed=0, dtype=torch.float32, *, D, I):
    """x [T, D] and the weights of S experts (gate_up [S, 2I, D], down [S, D, I]), seeded."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=dtype)
    gate_up = torch.randn(S, 2 * I, D, generator=g, dtype=dtype) / D ** 0.5
    down = torch.randn(S, D, I, generator=g, dtype=dtype) / I ** 0.5
    return x, gate_up, down


def expert_reference(x, slots, weights, gate_up, down):
    """y[t] = sum over kept k of w[t,k] * down_s(silu(gate_s x[t]) * up_s x[t]), in float64.
    gate_up [S, 2I, D] (rows [0, I) gate), down [S, D, I]; slot ids >= S are dropped."""
    S, I = gate_up.shape[0], gate_up.shape[1] // 2
    x, weights, gate_up, down = (a.double() for a in (x, weights, gate_up, down))
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(slots.shape[1]):
            s = int(slots[t, k])
            if s >= S:
                continue
            gate, up = gate_up[s, :I] @ x[t], gate_up[s, I:] @ x[t]
            y[t] += weights[t, k] * (down[s] @ (F.silu(gate) * up))
    return y


class CountOps(TorchDispatchMode):
    """`with CountOps() as c: ...` -> c.calls, the names of the torch ops run (this thread only)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
