"""`TensorParallel`: what a layer split over the TP ranks needs, taken from its plan at construction.

Megatron-style, as vLLM and SGLang split these layers: a layer's first projections
are split by output features (attention heads, the MLP's intermediate features), its
last one by input features, so each rank holds a partial sum of the layer's output
and one all-reduce over the TP group completes it. Embedding, router, norms and
lm_head are replicated. The ranks come from the plan (`parallel.tp_size/tp_rank`),
the group from the process's parallel context (engine/parallel/context.py); a
single process with tp_size > 1 has no group and must set `reduce` itself (tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import context as parallel_context


def _no_group(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("tp_size > 1 but no TP process group: set engine.parallel.context before building "
                       "(engine/worker.py does), or the layer's tp.reduce in a single-process test")


@dataclass
class TensorParallel:
    size: int = 1
    reduce: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda x: x, repr=False)

    @classmethod
    def of(cls, plan) -> "TensorParallel":
        """The plan's TP ranks and, with tp_size > 1, this process's TP group (which must agree)."""
        par = plan.request.parallel
        if par.tp_size == 1:
            return cls()
        ctx = parallel_context.current()
        if ctx is None:
            return cls(par.tp_size, _no_group)
        g = ctx.grid
        if (g.tp_size, g.tp_rank) != (par.tp_size, par.tp_rank):
            raise ValueError(f"plan is for tp rank {par.tp_rank}/{par.tp_size} but this process is tp rank "
                             f"{g.tp_rank}/{g.tp_size}")
        from .a2a import all_reduce_sum

        return cls(par.tp_size, functools.partial(all_reduce_sum, group=g.tp_group))

    def split(self, n: int, what: str) -> int:
        """This rank's share of `n` (heads, features), which must divide over the TP ranks."""
        if n % self.size:
            raise ValueError(f"{what}={n} does not divide over tp_size={self.size}")
        return n // self.size

    def output_projection(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """`proj(x)` for a layer's last projection, split by input features: this rank's partial
        product all-reduced over the TP group, then the bias (whole on every rank) added once."""
        if self.size == 1:
            return proj(x)
        out = self.reduce(F.linear(x, proj.weight))
        return out if proj.bias is None else out + proj.bias
