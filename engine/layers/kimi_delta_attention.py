"""Kimi Delta Attention (KDA): Kimi-Linear's linear-attention layers, following transformers'
modeling_kimi_linear.py numerically. Gated DeltaNet (layers/gated_delta_net.py) with a decay per head AND key
channel instead of one per head.

Shapes: B batch, T new tokens, D hidden, H heads (this rank's), d head dim (keys and values alike), C = 3 H d conv
channels, K the conv kernel, S the recurrent state [B, H, d, d].

Per token t, after a depthwise causal conv (kernel K, SiLU) over q_proj(x), k_proj(x), v_proj(x) (one conv
weight each: q_conv1d, k_conv1d, v_conv1d):
    q, k = l2norm(q), l2norm(k); q = q / sqrt(d); beta = sigmoid(b_proj(x))                 [H]
    f = f_b_proj(f_a_proj(x)) + dt_bias                                                    [H, d]
    g = -exp(A_log) softplus(f)                                                            [H, d]: log decays
    S = diag(exp(g)) S                                  decay, each key channel its own
    S = S + k (beta (v - S^T k))^T                      the delta rule
    o = S^T q
then an RMSNorm per head whose weight and sigmoid(g_b_proj(g_a_proj(x))) gate it in float32, and o_proj. The
recurrence runs in float32; dt_bias is kept float32 as transformers keeps it.

`style` "kimi" is Kimi-Linear's; "ling" is the Ling 3 models' (Bailing hybrid, models/bailing_hybrid.py): full-rank
gate projections (f_proj, g_proj: x -> [H, d]), the convolutions in float32, and with `lower_bound` b the bounded
("safe") decay g = b sigmoid(exp(A_log) f) instead of the softplus one, cast to the model's dtype as transformers
casts it; their A_log float32 too.

Long inputs (a prefill) run chunked (`kda_chunked`): within a chunk the delta rule's writes are one triangular
solve, with the pairwise decays exp(G_i - G_j) per channel (G the cumulative log decay within the chunk), across
chunks one state carry. Short ones (decode, a speculative round's verification) run token by token
(gated_delta_net.delta_rule_steps), which yields the state after every position for the cache to keep.

Under tensor parallelism a rank holds H / tp_size heads: q/k/v_proj, their convs, f_b_proj / f_proj, dt_bias,
A_log, b_proj and g_b_proj / g_proj by head (rows), o_proj by input columns, all-reduced; f_a_proj and g_a_proj
(hidden -> d, shared by the heads) and o_norm (per head) whole on every rank.

The cache (`LinearStateCache` of layers/gated_delta_net.py) keeps the conv's last inputs and the states after
the last positions written, so a speculative round that keeps fewer tokens than it wrote continues where it kept
them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor import TensorParallel
from .gated_delta_net import CHUNK, StateMixer, continue_from, delta_rule, l2norm
from .norm import SigmoidGatedRMSNorm


def kda_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The recurrence a chunk at a time. q/k [B, H, T, d], v [B, H, T, dv], g [B, H, T, d], beta [B, H, T], state S
    [B, H, d, dv] (all float32) -> (o [B, H, T, dv], the final state)."""
    B, H, T, d = k.shape
    pad = (-T) % chunk
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))   # g = 0, beta = 0: no decay, no write
        beta = F.pad(beta, (0, pad))
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    out = torch.empty_like(v)
    for start in range(0, T + pad, chunk):
        part = slice(start, start + chunk)
        qc, kc, vc, bc = q[:, :, part], k[:, :, part], v[:, :, part], beta[:, :, part]
        G = g[:, :, part].cumsum(dim=2)                                  # [B, H, c, d]: log decay since the start
        # exp(G_i - G_j) per channel for j <= i (0 above): how much of position j's write is left at i
        decay = (G[:, :, :, None] - G[:, :, None]).masked_fill(later[..., None], float("-inf")).exp()  # [.., c, c, d]
        kk = (kc[:, :, :, None] * kc[:, :, None] * decay).sum(dim=-1)    # [B, H, c, c]: k_i . (decay_ij k_j)
        qk = (qc[:, :, :, None] * kc[:, :, None] * decay).sum(dim=-1)    # [B, H, c, c], diagonal included
        # The writes delta: (I + strictly lower(beta_i kk_ij)) delta = beta (v - S0^T (exp(G) k))
        system = kk * bc[..., None]
        decayed = G.exp()                                                # [B, H, c, d]: what is left of S0
        rhs = bc[..., None] * (vc - (kc * decayed) @ state)              # [B, H, c, dv]
        delta = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, :, part] = (qc * decayed) @ state + qk @ delta
        last = G[:, :, -1]                                               # [B, H, d]
        state = state * last.exp()[..., None] + (kc * (last[:, :, None] - G).exp()).transpose(-1, -2) @ delta
    return out[:, :, :T], state


STYLES = ("kimi", "ling")


class KimiDeltaAttention(StateMixer):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int, rms_norm_eps: float,
                 dtype: torch.dtype | None = None, tp: TensorParallel | None = None, *, style: str = "kimi",
                 lower_bound: float | None = None, heads_field: str = "linear_attn_config.num_heads"):
        super().__init__()
        if style not in STYLES:
            raise ValueError(f"style={style!r}: one of {', '.join(STYLES)}")
        if lower_bound is not None and style != "ling":
            raise ValueError("a bounded decay (lower_bound) is the ling style's")
        self.tp = tp = tp or TensorParallel()
        self.n = H = tp.split(num_heads, heads_field)
        self.d = d = head_dim
        self.kernel = conv_kernel
        self.channels = 3 * H * d
        self.low_rank = style == "kimi"
        self.lower_bound = lower_bound
        conv_dtype = dtype if self.low_rank else torch.float32     # transformers keeps Ling's convolutions float32
        self.q_proj = nn.Linear(hidden_size, H * d, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(hidden_size, H * d, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(hidden_size, H * d, bias=False, dtype=dtype)
        self.q_conv1d = nn.Conv1d(H * d, H * d, conv_kernel, groups=H * d, bias=False, dtype=conv_dtype)  # [Hd, 1, K]
        self.k_conv1d = nn.Conv1d(H * d, H * d, conv_kernel, groups=H * d, bias=False, dtype=conv_dtype)
        self.v_conv1d = nn.Conv1d(H * d, H * d, conv_kernel, groups=H * d, bias=False, dtype=conv_dtype)
        if self.low_rank:
            self.f_a_proj = nn.Linear(hidden_size, d, bias=False, dtype=dtype)
            self.f_b_proj = nn.Linear(d, H * d, bias=False, dtype=dtype)
            self.g_a_proj = nn.Linear(hidden_size, d, bias=False, dtype=dtype)
            self.g_b_proj = nn.Linear(d, H * d, bias=False, dtype=dtype)
        else:
            self.f_proj = nn.Linear(hidden_size, H * d, bias=False, dtype=dtype)
            self.g_proj = nn.Linear(hidden_size, H * d, bias=False, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.zeros(H * d, dtype=torch.float32), requires_grad=False)
        # One per head (Kimi-Linear's checkpoints hold it as [1, 1, H, 1]: models/kimi_linear.py shows it as [H]), in
        # the dtype transformers keeps it in
        self.A_log = nn.Parameter(torch.zeros(H, dtype=dtype if self.low_rank else torch.float32), requires_grad=False)
        self.b_proj = nn.Linear(hidden_size, H, bias=False, dtype=dtype)
        self.o_norm = SigmoidGatedRMSNorm(d, rms_norm_eps, dtype)
        self.o_proj = nn.Linear(H * d, hidden_size, bias=False, dtype=dtype)
        self.state_layout = (self.channels, self.kernel, (self.n, self.d, self.d))   # its LinearStateCache's

    def forward(self, x: torch.Tensor, cos=None, sin=None, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D] (cos, sin: unused, no rotary here; input_pos [T] needed with a cache)."""
        B, T, _ = x.shape
        H, d = self.n, self.d
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1).transpose(1, 2)   # [B, C, T]
        cache = self.kv_cache
        start, prefix, state = continue_from(cache, input_pos, T, B, "Kimi delta attention", lambda: (
            mixed.new_zeros(B, self.channels, self.kernel - 1), mixed.new_zeros(B, H, d, d, dtype=torch.float32)))
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])    # [C, 1, K]
        conv = F.silu(F.conv1d(torch.cat([prefix, mixed], dim=-1).to(weight.dtype), weight, groups=self.channels))
        q, k, v = conv.to(x.dtype).transpose(1, 2).float().split(H * d, dim=-1)                     # [B, T, Hd] each

        q = l2norm(q.reshape(B, T, H, d)) * d ** -0.5
        k = l2norm(k.reshape(B, T, H, d))
        v = v.reshape(B, T, H, d)
        beta = torch.sigmoid(self.b_proj(x).float())                                                # [B, T, H]
        f = (self.f_b_proj(self.f_a_proj(x)) if self.low_rank else self.f_proj(x)).float()
        f = (f + self.dt_bias.float()).view(B, T, H, d)
        rate = self.A_log.float().exp()[:, None]                                                    # [H, 1]
        if self.lower_bound is None:
            g = -rate * F.softplus(f)                                                               # [B, T, H, d]
        else:
            g = self.lower_bound * torch.sigmoid(rate * f)
        if not self.low_rank:
            g = g.to(x.dtype).float()        # transformers hands Ling's decays to the kernel in the model's dtype
        q, k, v, g, beta = (t.transpose(1, 2) for t in (q, k, v, g, beta))     # heads first: [B, H, T, ...]
        o = delta_rule(cache, start, mixed, (q, k, v, g, beta), state, kda_chunked)
        o = o.transpose(1, 2).to(x.dtype)                                                           # [B, T, H, d]
        gate = (self.g_b_proj(self.g_a_proj(x)) if self.low_rank else self.g_proj(x)).view(B, T, H, d)
        y = self.o_norm(o, gate).reshape(B, T, H * d)
        return self.tp.output_projection(self.o_proj, y)
