"""Mamba2: the state-space token mixer of hybrid models (Granite 4.0-H: models/granitemoe_hybrid.py), with a
state cache that rolls back.

Shapes: B batch, T new tokens, D hidden, H heads of P features (I = H P, the inner width), G groups of N state
features (each group's B and C serve H / G heads), K the conv kernel, C = I + 2 G N conv channels, S the state
[B, H, N, P].

    z, xBC, dt = in_proj(h)                   [I], [C], [H]
    x, B, C = silu(causal_depthwise_conv(xBC))    (channels [x of every head, B of every group, C of every group])
    dt = clamp(softplus(dt + dt_bias), time_step_limit); A = -exp(A_log)
per token t and head h:
    S = exp(dt A) S + B (dt x)^T              decay, then write (no delta rule: layers/gated_delta_net.py has one)
    y = S^T C + D x
then a gated RMSNorm over each group's heads (norm(y * silu(z)), `GroupedGatedRMSNorm`) and out_proj.
That is linear attention with q = C, k = B, v = dt x and a log decay dt A per position: long inputs (a prefill) run
a chunk at a time (`ssd_chunked`), short ones (decode, speculative verification) token by token (`ssd_steps`),
which yields the state after every position for the cache.

`LinearStateCache` (layers/gated_delta_net.py) keeps the conv's last inputs and the states by position, so a
speculative round that keeps fewer tokens than it wrote continues from where it kept them.

Under tensor parallelism a rank holds H / tp_size heads (their z, x and dt rows of in_proj, x conv channels, dt_bias,
A_log, D and norm features; out_proj's input columns, all-reduced) and the groups those heads read: G / tp_size of
them when they divide, else (G = 1, the published models) the one group, B and C replicated on every rank and the
norm's mean square summed over the ranks. `rows_by_rank` shows a checkpoint's in_proj and conv1d regrouped rank by
rank, so that weights.TP_SPLITS' contiguous split gives each rank its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor import TensorParallel
from ..shown_tensors import rows_by_rank as shown_rows_by_rank
from .gated_delta_net import StateMixer, continue_from

CHUNK = 64   # positions per chunk of the chunked form


def ssd_steps(q, k, v, g, state):
    """The recurrence token by token. q/k [B, H, T, N], v [B, H, T, P], g [B, H, T] (log decay), state S [B, H, N, P]
    (float32) -> (y [B, H, T, P], the states after each position [T, B, H, N, P])."""
    outs, states = [], []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp() + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((state * q[:, :, t, :, None]).sum(dim=-2))                  # S^T q  [B, H, P]
        states.append(state)
    return torch.stack(outs, dim=2), torch.stack(states)


def ssd_chunked(q, k, v, g, state, chunk: int = CHUNK):
    """The same recurrence a chunk at a time -> (y [B, H, T, P], the final state)."""
    B, H, T, _ = k.shape
    pad = (-T) % chunk
    if pad:   # g = 0, k = 0: the padding neither decays nor writes
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g = F.pad(g, (0, pad))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))                  # [B, H, n, c, .]
    cum = g.reshape(B, H, n, chunk).cumsum(dim=-1)           # [B, H, n, c]: log decay since the chunk's start
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()   # [.., c, c] j -> i
    within = ((q @ k.transpose(-1, -2)) * decay) @ v                            # [.., c, P]: this chunk's writes
    q_decayed = q * cum.exp()[..., None]                                        # reads the chunk's start state
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]                       # writes, decayed to its end
    out = torch.empty_like(v)
    for i in range(n):
        out[:, :, i] = within[:, :, i] + q_decayed[:, :, i] @ state
        state = state * cum[:, :, i, -1, None, None].exp() + k_to_end[:, :, i].transpose(-1, -2) @ v[:, :, i]
    return out.reshape(B, H, n * chunk, -1)[:, :, :T], state


def ssd(q, k, v, g, state, per_position: bool):
    """The recurrence of `ssd_steps` / `ssd_chunked` -> (y [B, H, T, P], states [n, B, H, N, P]): token by token
    with the state after every position when `per_position` (a short forward with a cache: decode, verification),
    else a chunk at a time with the final state alone (n = 1)."""
    if per_position:
        return ssd_steps(q, k, v, g, state)
    y, final = ssd_chunked(q, k, v, g, state)
    return y, final[None]


class GroupedGatedRMSNorm(nn.Module):
    """y * silu(z), then RMS-normalised over each of `groups` equal slices of the features, in float32, scaled by the
    weight (Mamba2's output norm with its gate before the norm: transformers' BambaRMSNormGated). With `reduce` the
    one group is split over tensor-parallel ranks: each sums its squares, `reduce` sums them over the ranks, and the
    mean is over `full_dim`."""

    def __init__(self, dim: int, groups: int, eps: float, dtype: torch.dtype | None = None, *,
                 full_dim: int | None = None, reduce=None):
        super().__init__()
        if dim % groups:
            raise ValueError(f"{dim} features do not split into {groups} norm groups")
        if reduce is not None and groups != 1:
            raise ValueError("a norm group split over ranks is the only group of its rank")
        self.groups, self.eps, self.full_dim, self.reduce = groups, eps, full_dim, reduce
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y [..., I] (float32), z [..., I] -> float32 [..., I]"""
        h = y.float() * F.silu(z.float())
        h = h.unflatten(-1, (self.groups, -1))
        if self.reduce is None:
            mean_square = h.pow(2).mean(-1, keepdim=True)
        else:
            mean_square = self.reduce(h.pow(2).sum(-1, keepdim=True)) / self.full_dim
        return self.weight * (h * torch.rsqrt(mean_square + self.eps)).flatten(-2)


@dataclass(frozen=True)
class Mamba2Spec:
    """One Mamba2 mixer's sizes (the module doc's H, P, G, N, K) and switches."""

    hidden_size: int
    n_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    rms_norm_eps: float
    time_step_limit: tuple[float, float]
    fields: tuple[str, str] = ("mamba_n_heads", "mamba_n_groups")   # the config's names of H and G, for errors


class Mamba2Mixer(StateMixer):
    def __init__(self, spec: Mamba2Spec, *, tp: TensorParallel | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        hidden_size, n_heads, head_dim, n_groups = spec.hidden_size, spec.n_heads, spec.head_dim, spec.n_groups
        state_size, conv_kernel, rms_norm_eps, proj_bias = spec.state_size, spec.conv_kernel, spec.rms_norm_eps, \
            spec.proj_bias
        time_step_limit, conv_bias = spec.time_step_limit, spec.conv_bias
        heads_field, groups_field = spec.fields
        if n_heads % n_groups:
            raise ValueError(f"{heads_field}={n_heads} is not a multiple of {groups_field}={n_groups}")
        self.tp = tp = tp or TensorParallel()
        groups_split = tp.size > 1 and n_groups % tp.size != 0
        if groups_split and n_groups != 1:
            raise ValueError(f"{groups_field}={n_groups} does not divide over tp_size={tp.size} (and is not 1, "
                             f"one group every rank reads)")
        # this rank's heads, and the groups they read
        self.H, self.P, self.N, self.kernel = tp.split(n_heads, heads_field), head_dim, state_size, conv_kernel
        self.G = 1 if groups_split else n_groups // tp.size
        n_heads, n_groups = self.H, self.G
        self.inner = n_heads * head_dim
        self.channels = self.inner + 2 * n_groups * state_size
        self.time_step_limit = time_step_limit
        self.in_proj = nn.Linear(hidden_size, self.inner + self.channels + n_heads, bias=proj_bias, dtype=dtype)
        self.conv1d = nn.Conv1d(self.channels, self.channels, conv_kernel, groups=self.channels, bias=conv_bias,
                                dtype=dtype)                                    # weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(n_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(n_heads, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.ones(n_heads, dtype=dtype), requires_grad=False)
        self.norm = GroupedGatedRMSNorm(self.inner, n_groups, rms_norm_eps, dtype, full_dim=self.inner * tp.size,
                                        reduce=tp.reduce) if groups_split else \
            GroupedGatedRMSNorm(self.inner, n_groups, rms_norm_eps, dtype)
        self.out_proj = nn.Linear(self.inner, hidden_size, bias=proj_bias, dtype=dtype)
        self.state_layout = (self.channels, self.kernel, (self.H, self.N, self.P))   # its LinearStateCache's

    def forward(self, x: torch.Tensor, cos=None, sin=None, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D] (cos, sin: unused, no rotary here; input_pos [T] needed with a cache)."""
        B, T, _ = x.shape
        H, P, G, N = self.H, self.P, self.G, self.N
        z, xbc, dt = self.in_proj(x).split([self.inner, self.channels, H], dim=-1)
        xbc = xbc.transpose(1, 2)                                               # [B, C, T]

        cache = self.kv_cache
        start, prefix, state = continue_from(cache, input_pos, T, B, "Mamba2", lambda: (
            xbc.new_zeros(B, self.channels, self.kernel - 1), xbc.new_zeros(B, H, N, P, dtype=torch.float32)))
        weight = self.conv1d.weight
        conv = F.silu(F.conv1d(torch.cat([prefix, xbc], dim=-1).to(weight.dtype), weight, self.conv1d.bias,
                               groups=self.channels)).to(x.dtype)              # [B, C, T]
        xs, b, c = conv.transpose(1, 2).split([self.inner, G * N, G * N], dim=-1)

        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp(*self.time_step_limit).float()   # [B, T, H]
        g = dt * -self.A_log.float().exp()                                      # log decay [B, T, H]
        xs = xs.reshape(B, T, H, P).float()
        k = b.reshape(B, T, G, N).float().repeat_interleave(H // G, dim=2)     # [B, T, H, N]
        q = c.reshape(B, T, G, N).float().repeat_interleave(H // G, dim=2)
        q, k, v, g = (t.transpose(1, 2) for t in (q, k, xs * dt[..., None], g))   # heads first: [B, H, T, ...]
        y, states = ssd(q, k, v, g, state.float(), per_position=cache is not None and T <= cache.snapshots)
        if cache is not None:
            cache.write(start, xbc, states)

        y = y.transpose(1, 2) + xs * self.D.float()[:, None]                   # [B, T, H, P]
        y = self.norm(y.reshape(B, T, self.inner), z)
        return self.tp.output_projection(self.out_proj, y.to(x.dtype))


def rows_by_rank(ckpt, prefixes: list[str], tp_size: int, n_heads: int, head_dim: int, n_groups: int,
                 state_size: int):
    """`ckpt` with the in_proj and conv1d tensors of each Mamba2 layer under `prefixes` (e.g.
    "model.layers.0.mamba.") regrouped rank by rank (shown_tensors.rows_by_rank): in_proj's rows [z | x | B | C | dt]
    as [z_0 x_0 B_0 C_0 dt_0 | z_1 ...] and the conv's channels [x | B | C] as [x_0 B_0 C_0 | ...], where z_r, x_r,
    dt_r are rank r's heads' and B_r, C_r its groups' (the whole of each where one group serves every rank)."""
    inner, gn = n_heads * head_dim, n_groups * state_size
    shared = n_groups % tp_size != 0          # one group read by every rank: B and C repeated
    in_proj = ([inner, inner, gn, gn, n_heads], [False, False, shared, shared, False])
    conv = ([inner, gn, gn], [False, shared, shared])
    return shown_rows_by_rank(ckpt, tp_size, {"in_proj.weight": in_proj, "in_proj.bias": in_proj,
                                              "conv1d.weight": conv, "conv1d.bias": conv}, tuple(prefixes))
