"""Mamba (the first): the selective state-space token mixer of Jamba (models/jamba.py), with a state cache that rolls
back.

Shapes: B batch, T new tokens, D hidden, I inner channels (mamba_expand D), N state features, R the rank of dt,
K the conv kernel, S the state [B, I, N].

    x, z = in_proj(h)                                  [I], [I]
    x = silu(causal_depthwise_conv(x))
    dt, b, c = x_proj(x)                               [R], [N], [N]; Jamba then RMS-normalises each
    dt = softplus(dt_proj(dt))                         [I] (dt_proj's bias inside the softplus)
per token t, channel i and state feature n (A = -exp(A_log), [I, N]: each channel its own decays):
    S[i, n] = exp(dt[i] A[i, n]) S[i, n] + dt[i] b[n] x[i]
    y[i] = sum_n S[i, n] c[n] + D[i] x[i]
then y * silu(z) and out_proj. A decay per (channel, state feature) has no cheap chunked form: the scan runs token by
token (`selective_scan`), which also yields the state after every position for the cache.

`LinearStateCache` (layers/gated_delta_net.py) keeps the conv's last inputs and the states by position, so a
speculative round that keeps fewer tokens than it wrote continues from where it kept them.

Under tensor parallelism a rank holds I / tp_size channels: their x and z rows of in_proj (`in_proj_by_rank` shows a
checkpoint's in_proj regrouped rank by rank, so that weights.TP_SPLITS' contiguous split gives each its own), conv
channels, dt_proj rows, A_log and D rows, out_proj columns (all-reduced). x_proj reads every channel: each rank's
product is a partial sum, all-reduced before dt, b and c are normalised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor import TensorParallel
from ..shown_tensors import rows_by_rank
from .gated_delta_net import StateMixer, continue_from
from .norm import RMSNorm


def selective_scan(x, dt, A, b, c, state):
    """x/dt [B, T, I], A [I, N], b/c [B, T, N], state S [B, I, N] (float32) -> (y [B, T, I] without the skip, the
    states after each position [T, B, I, N])."""
    ys, states = [], []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t, :, None] * A)                                  # [B, I, N]
        state = decay * state + (dt[:, t] * x[:, t])[:, :, None] * b[:, t, None, :]
        ys.append((state * c[:, t, None, :]).sum(dim=-1))                         # [B, I]
        states.append(state)
    return torch.stack(ys, dim=1), torch.stack(states)


class Mamba1Mixer(StateMixer):
    def __init__(self, hidden_size: int, inner: int, state_size: int, dt_rank: int, conv_kernel: int,
                 conv_bias: bool, proj_bias: bool, rms_norm_eps: float, dtype: torch.dtype | None = None,
                 bcdt_norms: bool = True, tp: TensorParallel | None = None):
        """`bcdt_norms`: RMS-normalise dt, b and c after x_proj (Jamba's dt_layernorm, b_layernorm, c_layernorm)."""
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        inner = tp.split(inner, "mamba_expand * hidden_size")   # this rank's channels
        self.inner, self.N, self.R, self.kernel = inner, state_size, dt_rank, conv_kernel
        self.in_proj = nn.Linear(hidden_size, 2 * inner, bias=proj_bias, dtype=dtype)
        self.conv1d = nn.Conv1d(inner, inner, conv_kernel, groups=inner, bias=conv_bias, dtype=dtype)   # [I, 1, K]
        self.x_proj = nn.Linear(inner, dt_rank + 2 * state_size, bias=False, dtype=dtype)
        self.dt_proj = nn.Linear(dt_rank, inner, bias=True, dtype=dtype)
        self.A_log = nn.Parameter(torch.zeros(inner, state_size, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.ones(inner, dtype=dtype), requires_grad=False)
        self.out_proj = nn.Linear(inner, hidden_size, bias=proj_bias, dtype=dtype)
        self.dt_layernorm = self.b_layernorm = self.c_layernorm = None
        if bcdt_norms:
            self.dt_layernorm = RMSNorm(dt_rank, rms_norm_eps, dtype)
            self.b_layernorm = RMSNorm(state_size, rms_norm_eps, dtype)
            self.c_layernorm = RMSNorm(state_size, rms_norm_eps, dtype)
        self.state_layout = (self.inner, self.kernel, (self.inner, self.N))   # its LinearStateCache's

    def forward(self, h: torch.Tensor, cos=None, sin=None, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, T, D] -> [B, T, D] (cos, sin: unused, no rotary here; input_pos [T] needed with a cache)."""
        B, T, _ = h.shape
        x, z = self.in_proj(h).transpose(1, 2).chunk(2, dim=1)                    # [B, I, T] each
        cache = self.kv_cache
        start, prefix, state = continue_from(cache, input_pos, T, B, "Mamba", lambda: (
            x.new_zeros(B, self.inner, self.kernel - 1), x.new_zeros(B, self.inner, self.N, dtype=torch.float32)))
        weight = self.conv1d.weight
        conv = F.silu(F.conv1d(torch.cat([prefix, x], dim=-1).to(weight.dtype), weight, self.conv1d.bias,
                               groups=self.inner)).to(h.dtype).transpose(1, 2)  # [B, T, I]
        projected = self.x_proj(conv) if self.tp.size == 1 else self.tp.reduce(F.linear(conv, self.x_proj.weight))
        dt, b, c = projected.split([self.R, self.N, self.N], dim=-1)
        if self.dt_layernorm is not None:
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        dt = F.softplus((dt @ self.dt_proj.weight.t()).float() + self.dt_proj.bias.float())   # [B, T, I]
        A = -self.A_log.float().exp()
        xs = conv.float()
        y, states = selective_scan(xs, dt, A, b.float(), c.float(), state.float())
        if cache is not None:
            cache.write(start, x, states[-min(T, cache.snapshots):])
        y = (y + xs * self.D.float()) * F.silu(z.transpose(1, 2).float())     # [B, T, I]
        return self.tp.output_projection(self.out_proj, y.to(h.dtype))


def in_proj_by_rank(ckpt, prefixes: list[str], tp_size: int, inner: int):
    """`ckpt` with the in_proj of each Mamba layer under `prefixes` (e.g. "model.layers.0.mamba.") regrouped rank by
    rank (shown_tensors.rows_by_rank): its rows [x | z] as [x_0 z_0 | x_1 z_1 | ...], where x_r, z_r are rank r's
    channels."""
    layout = ([inner, inner], [False, False])
    return rows_by_rank(ckpt, tp_size, {"in_proj.weight": layout, "in_proj.bias": layout}, tuple(prefixes))
