"""The dense SwiGLU MLP: down(act(gate(x)) * up(x)), HF's gate_proj/up_proj/down_proj names; and the ungated one,
down(act(up(x))) (Nemotron-H's relu^2 MLP, `UngatedMLP`).

Under tensor parallelism (`tp`) a rank holds intermediate_size / tp_size features (gate and up
split by output, down by input): its output is a partial sum, all-reduced over the TP group."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor import TensorParallel

ACTIVATIONS = {"silu": F.silu}
# The activations of ungated MLPs and experts (an activation of its own, not a gate's).
UNGATED_ACTIVATIONS = {"relu2": lambda x: F.relu(x).square()}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"hidden_act {name!r} not supported; supported: {', '.join(sorted(ACTIVATIONS))}") from None


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
                 dtype: torch.dtype | None = None, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        intermediate_size = tp.split(intermediate_size, "intermediate_size")
        self.act = activation(hidden_act)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.output_projection(self.down_proj, self.act(self.gate_proj(x)) * self.up_proj(x))


class UngatedMLP(nn.Module):
    """down(act(up(x))), with optional biases (`bias`); `act` one of UNGATED_ACTIVATIONS."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False,
                 dtype: torch.dtype | None = None, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        intermediate_size = tp.split(intermediate_size, "intermediate_size")
        self.act = UNGATED_ACTIVATIONS[act]
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.output_projection(self.down_proj, self.act(self.up_proj(x)))
