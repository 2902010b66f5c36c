"""RMSNorm as the HF MoE families compute it: in float32, scaled by the weight in the input dtype.

`reduce`: the vector is split over tensor-parallel ranks (OLMoE's norm over a whole q or k
projection, each rank holding its heads' features): each rank sums its squares, `reduce` sums
them over the ranks, and the mean is over `full_dim`."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None, *,
                 full_dim: int | None = None, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        if (full_dim is None) != (reduce is None):
            raise ValueError("full_dim and reduce go together (a norm split over ranks)")
        self.eps = eps
        self.full_dim, self.reduce = full_dim, reduce
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self._normalized(x).to(x.dtype)

    def _normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x in float32 divided by its root mean square (over the ranks' whole vector with `reduce`)."""
        h = x.float()
        if self.reduce is None:
            variance = h.pow(2).mean(-1, keepdim=True)
        else:
            variance = self.reduce(h.pow(2).sum(-1, keepdim=True)) / self.full_dim
        return h * torch.rsqrt(variance + self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class WeightFirstRMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies the float32 normalised vector before the cast back (OLMo 2's and FlexOlmo's
    norms): alike in float32, one rounding fewer in bfloat16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * self._normalized(x)).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm with a weight and a bias (Phi-3.5-MoE's norms), built like RMSNorm: (dim, eps, dtype)."""

    BIAS = True

    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype | None = None):
        super().__init__(dim, eps=eps, elementwise_affine=True, bias=self.BIAS, dtype=dtype)
        self.requires_grad_(False)


class BiaslessLayerNorm(LayerNorm):
    """LayerNorm with a weight only (DBRX's norms)."""

    BIAS = False


class OffsetRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored as an offset from 1 (Qwen3-Next's norms): the checkpoint's zeros are
    the identity, and the scale (1 + weight) is applied in float32 before the cast back, as transformers'
    Qwen3NextRMSNorm computes it."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__(dim, eps, dtype)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm of x, then times silu(gate) in float32 (the output norm of a gated-delta-net layer, applied per
    value head: layers/gated_delta_net.py)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) * torch.nn.functional.silu(gate.float())).to(x.dtype)


class SigmoidGatedRMSNorm(RMSNorm):
    """RMSNorm of x times its weight, then times sigmoid(gate), all in float32 (Kimi Delta Attention's output norm,
    per head: layers/kimi_delta_attention.py; transformers' KimiLinearRMSNormGated casts only the result back)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * self._normalized(x) * torch.sigmoid(gate.float())).to(x.dtype)
