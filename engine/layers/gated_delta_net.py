"""Gated DeltaNet: the linear-attention layers of Qwen3-Next, with a state cache that rolls back.

Shapes: B batch, T new tokens, D hidden, Hk key heads, Hv value heads (this rank's; each key head
serves r = Hv / Hk value heads), dk / dv key / value head dims, C = 2 Hk dk + Hv dv conv channels,
K the conv kernel, S the recurrent state [B, Hv, dk, dv].

Per token t, after a depthwise causal conv (kernel K, SiLU) over the concatenated q, k, v:
    q, k = l2norm(q), l2norm(k); q = q / sqrt(dk); beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias)
    S = exp(g) S                                     decay
    S = S + k (beta (v - S^T k))^T                   the delta rule: write only what S does not predict
    o = S^T q
then a gated RMSNorm per value head (norm(o) * silu(z)) and out_proj. The conv's channels are
[q of every head, k of every head, v of every head]. The input projections come two ways
(`projections`): "grouped" (Qwen3-Next), laid out per key head, in_proj_qkvz's rows [q (dk), k (dk),
v (r dv), z (r dv)] for each key head and in_proj_ba's [b (r), a (r)]; "separate" (Qwen3.5),
in_proj_qkv's rows in the conv's channel order, and in_proj_z, in_proj_b, in_proj_a by value head.

Long inputs (a prefill) run chunked: within a chunk the delta rule's updates are one triangular solve
(the UT transform), across chunks one state carry, so the Python loop is per chunk, not per token.

Under tensor parallelism a rank holds Hk / tp_size key heads and their value heads: in_proj_qkvz and
in_proj_ba split by output rows (each key head's block is contiguous), the conv's channels and
in_proj_qkv's rows take the rank's part of each of q, k and v (the model's checkpoint view regroups
them rank by rank), in_proj_z/b/a, A_log and dt_bias by value head, out_proj by input columns,
all-reduced.

`LinearStateCache` (`setup_cache`) keeps what the next forward needs: the conv's last K - 1 inputs and
the state S. A speculative round writes past the tokens it keeps and then rolls back, which a state
cannot undo, so with `lookahead` L the cache keeps the states after each of the last L + 2 positions
written (the per-token recurrence, used whenever a forward is that short, yields them) and the conv
inputs of the last K + L: after a forward of up to L + 1 positions, the next may start anywhere in them
(or right after). A start further back is refused, not run from the wrong state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor import TensorParallel
from .norm import GatedRMSNorm

CHUNK = 64   # positions per chunk of the chunked form
PROJECTIONS = ("grouped", "separate")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_steps(q, k, v, g, beta, state):
    """The recurrence token by token. q/k [B, H, T, dk], v [B, H, T, dv], beta [B, H, T], g [B, H, T] (a decay per
    head) or [B, H, T, dk] (per key channel: layers/kimi_delta_attention.py), state S (float32)
    -> (o [B, H, T, dv], the states after each position [T, B, H, dk, dv])."""
    outs, states = [], []
    per_channel = g.dim() == 4
    for t in range(q.shape[2]):
        decay = g[:, :, t].exp()                                               # [B, H] or [B, H, dk]
        state = state * (decay[..., None] if per_channel else decay[..., None, None])
        kt = k[:, :, t]                                                        # [B, H, dk]
        predicted = (state * kt[..., None]).sum(dim=-2)                        # [B, H, dv]: S^T k
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + kt[..., None] * delta[..., None, :]
        outs.append((state * q[:, :, t, :, None]).sum(dim=-2))                 # S^T q
        states.append(state)
    return torch.stack(outs, dim=2), torch.stack(states)


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same recurrence a chunk at a time -> (o [B, H, T, dv], the final state)."""
    B, H, T, dk = k.shape
    pad = (-T) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))     # g = 0, beta = 0: no decay, no write
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))                # [B, H, N, c, d]
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    cum = g.cumsum(dim=-1)                                   # [B, H, N, c]: log decay since the chunk's start
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()   # [.., c, c] j -> i
    kb = k * beta[..., None]
    # (I + strictly lower(beta_i k_i.k_j decay_ij)) W = [beta v, beta k exp(cum)]: the chunk's writes as if from S0
    system = (kb @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta[..., None], kb * cum.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    writes, reads = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]       # [.., c, dv], [.., c, dk]
    attn = (q @ k.transpose(-1, -2)) * decay                                    # [.., c, c], diagonal included
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(v)
    for i in range(n):
        v_new = writes[:, :, i] - reads[:, :, i] @ state                        # [B, H, c, dv]
        out[:, :, i] = q_decayed[:, :, i] @ state + attn[:, :, i] @ v_new
        state = state * cum[:, :, i, -1, None, None].exp() + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(B, H, n * chunk, -1)[:, :, :T], state


class LinearStateCache(nn.Module):
    """The conv inputs and recurrent states of one layer, by position (see the module docstring)."""

    def __init__(self, batch_size: int, channels: int, conv_kernel: int, state_shape: tuple[int, int, int],
                 lookahead: int, dtype: torch.dtype, device):
        super().__init__()
        slots = conv_kernel + lookahead
        self.register_buffer("conv", torch.zeros(batch_size, channels, slots, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("conv_pos", torch.full((slots,), -1, dtype=torch.long, device=device),
                             persistent=False)
        self.register_buffer("states", torch.zeros(lookahead + 2, batch_size, *state_shape, dtype=torch.float32,
                                                   device=device), persistent=False)
        self.register_buffer("state_pos", torch.full((lookahead + 2,), -1, dtype=torch.long, device=device),
                             persistent=False)
        self.kernel = conv_kernel

    @property
    def snapshots(self) -> int:
        return self.states.shape[0]

    def read(self, start: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a forward starting at `start` continues from: (the conv inputs of positions start-K+1 .. start-1
        [B, C, K-1], zeros before 0; the state after position start-1, zeros at 0)."""
        if start == 0:
            state = torch.zeros_like(self.states[0, :batch])
        else:
            slot = (start - 1) % self.snapshots
            if int(self.state_pos[slot]) != start - 1:
                raise self._lost(start - 1, start)
            state = self.states[slot, :batch]
        # As the sliding-window KV cache checks its ring (layers/kv_cache.py): one comparison, no per-slot syncs.
        needed = torch.arange(max(0, start - self.kernel + 1), start, device=self.conv_pos.device)
        slots = needed % self.conv_pos.numel()
        held = self.conv_pos[slots]
        if not torch.equal(held, needed):
            raise self._lost(int(needed[held != needed][0]), start)
        prefix = torch.zeros(batch, self.conv.shape[1], self.kernel - 1, dtype=self.conv.dtype,
                             device=self.conv.device)
        prefix[:, :, self.kernel - 1 - needed.numel():] = self.conv[:batch, :, slots]   # zeros before position 0
        return prefix, state

    def write(self, start: int, inputs: torch.Tensor, states: torch.Tensor) -> None:
        """inputs [B, C, T] at positions start .. start+T-1; states [n, B, ...]: the states after the last n of them."""
        B, _, T = inputs.shape
        keep = min(T, self.conv_pos.numel())
        positions = torch.arange(start + T - keep, start + T, device=self.conv_pos.device)
        slots = positions % self.conv_pos.numel()
        self.conv[:B, :, slots] = inputs[:, :, T - keep:]
        self.conv_pos[slots] = positions
        n = min(states.shape[0], self.snapshots)
        positions = torch.arange(start + T - n, start + T, device=self.state_pos.device)
        slots = positions % self.snapshots
        self.states[slots, :B] = states[states.shape[0] - n:].to(self.states.dtype)   # float32 whatever the model's
        self.state_pos[slots] = positions

    def _lost(self, position: int, start: int) -> RuntimeError:
        return RuntimeError(f"the linear-attention state cache no longer holds position {position}, which a "
                            f"forward from position {start} continues from: it keeps the last "
                            f"{self.snapshots} states written; set up the caches with lookahead >= "
                            f"how far a round writes past the tokens it keeps")


class StateMixer(nn.Module):
    """A token mixer whose cache is a `LinearStateCache` of `state_layout` (conv channels, conv kernel, each batch
    row's recurrent state shape), which its constructor sets; the model's setup_caches makes it (`kv_cache`, named
    as attention's)."""

    def __init__(self):
        super().__init__()
        self.kv_cache: LinearStateCache | None = None
        self.state_layout: tuple[int, int, tuple[int, ...]] = (0, 0, ())

    def setup_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype, device,
                    lookahead: int = 0) -> LinearStateCache:
        """`max_seq_len` does not matter: the state is the same size at every length."""
        self.kv_cache = LinearStateCache(batch_size, *self.state_layout, lookahead, dtype, device)
        return self.kv_cache


def delta_rule(cache: LinearStateCache | None, start: int, mixed: torch.Tensor, qkvgb: tuple, state: torch.Tensor,
               chunked) -> torch.Tensor:
    """The delta rule over the new tokens (q, k, v, g, beta heads first, [B, H, T, ...]) from `state`: a state per
    position where the cache keeps one for each (short: decode, verification), else `chunked` (the family's chunked
    form); the cache written with the conv inputs `mixed` from `start`. -> o [B, H, T, dv]"""
    q = qkvgb[0]
    state = state.float()
    if cache is not None and q.shape[2] <= cache.snapshots:
        o, states = delta_rule_steps(*qkvgb, state)
    else:
        o, final = chunked(*qkvgb, state)
        states = final[None]
    if cache is not None:
        cache.write(start, mixed, states)
    return o


def continue_from(cache: LinearStateCache | None, input_pos: torch.Tensor | None, T: int, B: int, what: str, zeros):
    """(start, conv prefix [B, C, K-1], state) a forward of T consecutive positions continues from: with a cache
    (input_pos then required), what it holds before input_pos[0]; without one, position 0 and `zeros()`'s (prefix,
    state): a whole sequence. `what` names the layer kind in errors. Every layer with a LinearStateCache reads it so."""
    if cache is None:
        if input_pos is not None and int(input_pos[0]) != 0:
            raise ValueError(f"without a state cache a {what} layer runs a whole sequence from position 0")
        return (0, *zeros())
    if input_pos is None:
        raise ValueError(f"a {what} layer's state cache is set up: pass input_pos")
    start = int(input_pos[0])
    if int(input_pos[-1]) - start != T - 1:
        raise ValueError(f"a {what} layer takes consecutive positions, got {input_pos.tolist()}")
    return (start, *cache.read(start, B))


class GatedDeltaNet(StateMixer):
    def __init__(self, hidden_size: int, n_k_heads: int, n_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_kernel: int, rms_norm_eps: float, dtype: torch.dtype | None = None,
                 tp: TensorParallel | None = None, projections: str = "grouped"):
        super().__init__()
        if projections not in PROJECTIONS:
            raise ValueError(f"projections={projections!r}: one of {', '.join(PROJECTIONS)}")
        if n_v_heads % n_k_heads:
            raise ValueError(f"linear_num_value_heads={n_v_heads} is not a multiple of "
                             f"linear_num_key_heads={n_k_heads}")
        self.tp = tp = tp or TensorParallel()
        self.r = n_v_heads // n_k_heads
        self.n_k = tp.split(n_k_heads, "linear_num_key_heads")
        self.n_v = self.n_k * self.r
        self.dk, self.dv, self.kernel = k_head_dim, v_head_dim, conv_kernel
        Hk, Hv, dk, dv = self.n_k, self.n_v, k_head_dim, v_head_dim
        self.channels = 2 * Hk * dk + Hv * dv
        self.grouped = projections == "grouped"
        if self.grouped:
            self.in_proj_qkvz = nn.Linear(hidden_size, Hk * (2 * dk + 2 * self.r * dv), bias=False, dtype=dtype)
            self.in_proj_ba = nn.Linear(hidden_size, Hk * 2 * self.r, bias=False, dtype=dtype)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, self.channels, bias=False, dtype=dtype)
            self.in_proj_z = nn.Linear(hidden_size, Hv * dv, bias=False, dtype=dtype)
            self.in_proj_b = nn.Linear(hidden_size, Hv, bias=False, dtype=dtype)
            self.in_proj_a = nn.Linear(hidden_size, Hv, bias=False, dtype=dtype)
        self.conv1d = nn.Conv1d(self.channels, self.channels, conv_kernel, groups=self.channels, bias=False,
                                dtype=dtype)                                    # weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(Hv, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(Hv, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(dv, rms_norm_eps, dtype)
        self.out_proj = nn.Linear(Hv * dv, hidden_size, bias=False, dtype=dtype)
        self.state_layout = (self.channels, self.kernel, (self.n_v, self.dk, self.dv))   # its LinearStateCache's

    def forward(self, x: torch.Tensor, cos=None, sin=None, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D] (cos, sin: unused, no rotary here; input_pos [T] needed with a cache)."""
        B, T, _ = x.shape
        Hk, Hv, dk, dv, r = self.n_k, self.n_v, self.dk, self.dv, self.r
        mixed, z, b, a = self._project(x)                                     # [B, C, T], [B, T, Hv, dv], [B, T, Hv]

        cache = self.kv_cache
        start, prefix, state = continue_from(cache, input_pos, T, B, "linear-attention", lambda: (
            mixed.new_zeros(B, self.channels, self.kernel - 1), mixed.new_zeros(B, Hv, dk, dv, dtype=torch.float32)))
        conv = F.conv1d(torch.cat([prefix, mixed], dim=-1), self.conv1d.weight, groups=self.channels)   # [B, C, T]
        q, k, v = F.silu(conv).transpose(1, 2).split([Hk * dk, Hk * dk, Hv * dv], dim=-1)

        q = l2norm(q.reshape(B, T, Hk, dk).float()).repeat_interleave(r, dim=2) * dk ** -0.5   # [B, T, Hv, dk]
        k = l2norm(k.reshape(B, T, Hk, dk).float()).repeat_interleave(r, dim=2)
        v = v.reshape(B, T, Hv, dv).float()
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        q, k, v, beta, g = (t.transpose(1, 2) for t in (q, k, v, beta, g))    # heads first: [B, Hv, T, ...]
        o = delta_rule(cache, start, mixed, (q, k, v, g, beta), state, delta_rule_chunked)
        o = o.transpose(1, 2).to(x.dtype)                                     # [B, T, Hv, dv]
        y = self.norm(o, z).reshape(B, T, Hv * dv)
        return self.tp.output_projection(self.out_proj, y)

    def _project(self, x: torch.Tensor):
        """x [B, T, D] -> (the conv's input [B, C, T], z [B, T, Hv, dv], b and a [B, T, Hv])."""
        B, T, _ = x.shape
        Hk, Hv, dk, dv, r = self.n_k, self.n_v, self.dk, self.dv, self.r
        if not self.grouped:
            return (self.in_proj_qkv(x).transpose(1, 2), self.in_proj_z(x).view(B, T, Hv, dv), self.in_proj_b(x),
                    self.in_proj_a(x))
        q, k, v, z = self.in_proj_qkvz(x).view(B, T, Hk, 2 * dk + 2 * r * dv).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, Hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)   # [B, T, C]
        return mixed.transpose(1, 2), z.reshape(B, T, Hv, dv), b.reshape(B, T, Hv), a.reshape(B, T, Hv)
