"""Token exchange of the MoE forward paths over an EP process group (DESIGN 5.4).

`a2a` path: each rank routes ITS OWN tokens. `dispatch` sends every (token, slot)
pair to the rank owning that slot's expert, the owner computes the rows it received,
`combine` returns each row to its source rank, which sums the weighted rows per
token. The combined output is complete: no further reduction may follow
(`moe.post_experts_all_reduce` is false on this path; an extra all-reduce would sum
other ranks' tokens into this rank's: the double-reduction bug).

`normal` path: every rank holds ALL tokens, computes its local experts' partial sums,
and `all_reduce_sum` adds the partials once.

Ids in `topk_ids` are global (engine/moe.py): routed experts [0, num_routed) live on
rank id // num_local_experts; ids >= num_routed are fused shared slots, present on
every rank, so their pairs stay on the source rank (a send-to-self, no traffic).
Negative ids are dropped (masked slots). Transport is
torch.distributed.all_to_all_single with uneven splits (gloo supports it on CPU,
any dtype, empty splits included; NCCL on GPUs): one exchange of counts, then one
per payload.

How a MoE layer uses it on the `a2a` path (with post_experts_all_reduce false):

    rx, rids, rw, h = dispatch(x, topk_ids, topk_weights, E, ep_group, num_routed=n_routed)
    rows = experts_rows(rx, rids)              # bare expert output per received row
    y = combine(rows, h)                       # [T, D], complete
or, with a kernel that takes global ids and applies weights (RoutedExperts.forward):
    y = combine(experts(rx, global_slot_ids(rids, E, local_start, n_routed)[:, None], rw[:, None]),
                h, weighted=True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DispatchHandle:
    """What `combine` needs to route the computed rows back. Opaque to callers."""

    group: object
    num_tokens: int                    # T on this (source) rank
    send_splits: list[int]             # pairs sent to each rank
    recv_splits: list[int]             # rows received from each rank
    tokens: torch.Tensor               # [N_send] source token of each sent pair, in send order
    pair_weights: torch.Tensor         # [N_send] their routing weights, kept on the source


def _group_size_rank(group) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def _exchange(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    import torch.distributed as dist

    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def destinations(topk_ids: torch.Tensor, num_local_experts: int, num_routed: int, my_rank: int) -> torch.Tensor:
    """Destination EP rank of each (token, slot) pair; -1 for dropped pairs. Pure."""
    routed_owner = torch.div(topk_ids, num_local_experts, rounding_mode="floor")
    dest = torch.where(topk_ids >= num_routed, torch.full_like(topk_ids, my_rank), routed_owner)
    return torch.where(topk_ids < 0, torch.full_like(topk_ids, -1), dest)


def local_slot_ids(global_ids: torch.Tensor, num_local_experts: int, num_routed: int) -> torch.Tensor:
    """Global ids of pairs that arrived at their owner -> index into the owner's stacked
    [E + S] expert weights: routed id % E, fused slot s -> E + s. Pure."""
    return torch.where(global_ids >= num_routed, global_ids - num_routed + num_local_experts,
                       global_ids % num_local_experts)


def global_slot_ids(local_ids: torch.Tensor, num_local_experts: int, local_start: int,
                    num_routed: int) -> torch.Tensor:
    """Inverse of `local_slot_ids` on the owner (local_start = its first routed expert). Pure."""
    return torch.where(local_ids >= num_local_experts, local_ids - num_local_experts + num_routed,
                       local_ids + local_start)


def dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_local_experts: int,
             group=None, *, num_routed: int | None = None):
    """Send each (token, slot) pair to the rank owning its expert.

    x [T, D], topk_ids [T, K] global ids, topk_weights [T, K]. `num_routed` defaults to
    num_local_experts x the group size (no redundant experts); with EPLB pass the
    number of physical experts and physical ids.

    Returns (recv_x [N, D], recv_local_expert_ids [N] (index into this rank's [E + S]
    stacked experts), recv_weights [N], handle). Rows are grouped by source rank,
    not by expert: the expert kernel sorts them."""
    import torch.distributed as dist

    world, me = _group_size_rank(group)
    if num_routed is None:
        num_routed = num_local_experts * world
    T, K = topk_ids.shape
    if x.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)}: one row per token and one weight per id expected")
    if num_routed > num_local_experts * world:
        raise ValueError(f"num_routed={num_routed} > num_local_experts={num_local_experts} x ep_size={world}: "
                         f"some routed experts would have no owner")
    dest = destinations(topk_ids, num_local_experts, num_routed, me).reshape(-1)      # [T*K]
    keep = dest >= 0
    # Pairs grouped by destination rank (stable: token order within a destination).
    order = torch.argsort(torch.where(keep, dest, torch.full_like(dest, world)), stable=True)
    order = order[: int(keep.sum())]
    send_splits = torch.bincount(dest[order], minlength=world).tolist() if order.numel() else [0] * world
    token = torch.div(order, K, rounding_mode="floor")
    flat_ids = topk_ids.reshape(-1).index_select(0, order)
    flat_w = topk_weights.reshape(-1).index_select(0, order)

    counts = torch.tensor(send_splits, dtype=torch.int64, device=x.device)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_splits = recv_counts.tolist()

    recv_x = _exchange(x.index_select(0, token), send_splits, recv_splits, group)
    recv_ids = _exchange(flat_ids, send_splits, recv_splits, group)
    recv_w = _exchange(flat_w, send_splits, recv_splits, group)
    handle = DispatchHandle(group=group, num_tokens=T, send_splits=send_splits, recv_splits=recv_splits,
                            tokens=token, pair_weights=flat_w)
    return recv_x, local_slot_ids(recv_ids, num_local_experts, num_routed), recv_w, handle


def combine(expert_out: torch.Tensor, handle: DispatchHandle, *, weighted: bool = False) -> torch.Tensor:
    """Return the rows computed by `dispatch`'s receivers to their source ranks and sum them
    per token: -> [T, D], complete (no further reduction).

    expert_out [N, D] is in `recv_x`'s row order. By default the rows are the bare
    expert outputs and the routing weights are applied here (on the source, with the
    weights it routed with); pass weighted=True when the kernel already multiplied
    each row by its `recv_weights`."""
    back = _exchange(expert_out, handle.recv_splits, handle.send_splits, handle.group)   # [N_send, D]
    if not weighted:
        back = back * handle.pair_weights.to(back.dtype)[:, None]
    y = back.new_zeros((handle.num_tokens, *expert_out.shape[1:]))
    return y.index_add_(0, handle.tokens, back)


def all_reduce_sum(y: torch.Tensor, group=None) -> torch.Tensor:
    """`normal` path: sum the ranks' partial expert outputs (in place; returns y)."""
    import torch.distributed as dist

    if dist.get_world_size(group) > 1:
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y
