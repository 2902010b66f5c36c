"""The dense SwiGLU MLP: down(act(gate(x)) * up(x)), HF's gate_proj/up_proj/down_proj names.

Under tensor parallelism (`tp`) a rank holds intermediate_size / tp_size features (gate and up
split by output, down by input): its output is a partial sum, all-reduced over the TP group."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor import TensorParallel

ACTIVATIONS = {"silu": F.silu}


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
