"""Expert-parallel load balancing (EPLB): count tokens per expert, compute a placement
of physical expert slots that evens the load over EP ranks, move the expert weights.

Vocabulary. A MoE layer has `num_logical` routed experts (the checkpoint's). With EPLB
it holds `num_physical` >= num_logical slots, `num_physical / ep_size` per rank (rank r
owns slots [r*S, (r+1)*S)); the extra `num_physical - num_logical` slots are replicas of
hot experts. `phy2log[layer, slot]` says which logical expert a slot holds. Replicas
are exact copies, so routing a token to any replica of its expert leaves the output,
hence the logits, unchanged: `to_physical` picks one round-robin by token index.

Layers are keyed by GLOBAL layer id and only the local MoE layers of a pipeline stage
appear (DESIGN 5.5): everything here refuses a layer id it was not built for, so a
stage can never touch another stage's experts.

Pure torch; no process group needed except `ExpertLoadCounter.all_reduce`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch


def _row_of(layer_ids: Sequence[int], layer_id: int, what: str) -> int:
    try:
        return layer_ids.index(layer_id)
    except ValueError:
        raise KeyError(f"layer {layer_id} is not one of this {what}'s MoE layers {list(layer_ids)} "
                       f"(EPLB descriptors hold only the local pipeline stage's layers)") from None


# -- counting ------------------------------------------------------------------

class ExpertLoadCounter:
    """Tokens routed to each logical expert, per local MoE layer.

    A MoE layer calls `record(layer_id, topk_ids)` in its forward with the LOGICAL
    routed ids (before `to_physical`); fused shared slots (ids >= num_logical) and
    masked ids (< 0) are not movable experts and are not counted. One bincount per
    call, no host sync."""

    def __init__(self, layer_ids: Sequence[int], num_logical: int, device: torch.device | str | None = None):
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.num_logical = int(num_logical)
        self.counts = torch.zeros(len(self.layer_ids), self.num_logical, dtype=torch.int64, device=device)

    def record(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        row = _row_of(self.layer_ids, layer_id, "counter")
        ids = topk_ids.reshape(-1)
        n = self.num_logical
        ids = torch.where((ids >= 0) & (ids < n), ids, torch.full_like(ids, n))   # overflow bin, dropped
        self.counts[row] += torch.bincount(ids, minlength=n + 1)[:n].to(self.counts.device)

    def load(self) -> torch.Tensor:
        """[n_layers, num_logical] token counts, rows in `layer_ids` order."""
        return self.counts.clone()

    def reset(self) -> None:
        self.counts.zero_()

    def all_reduce(self, group=None) -> None:
        """Sum the counts over EP ranks. Needed on the `a2a` path (each rank routes its
        own tokens); on the `normal` path every rank routes all tokens, so the counts
        are already global (summing only scales them, which changes no placement)."""
        import torch.distributed as dist

        dist.all_reduce(self.counts, group=group)


# -- placement -----------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Placement:
    """Which logical expert each physical slot holds, per local MoE layer.

    phy2log [n_layers, num_physical]; log2phy [n_layers, num_logical, max_replicas]
    (the slots of each logical expert, ascending, -1 padded); logcnt [n_layers,
    num_logical] replica counts. When produced by `rebalance`, `max_over_mean_before`
    and `max_over_mean_after` [n_layers] report the per-rank load balance (max rank
    load / mean rank load; 1.0 is perfect) of the old and the new placement."""

    layer_ids: tuple[int, ...]
    phy2log: torch.Tensor
    ep_size: int
    num_logical: int
    max_over_mean_before: torch.Tensor | None = None
    max_over_mean_after: torch.Tensor | None = None
    log2phy: torch.Tensor = field(init=False, repr=False)
    logcnt: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        p2l = self.phy2log
        L, P = p2l.shape
        if L != len(self.layer_ids):
            raise ValueError(f"phy2log has {L} rows for {len(self.layer_ids)} layers")
        if P % self.ep_size:
            raise ValueError(f"{P} physical experts do not split over ep_size={self.ep_size}")
        if bool(((p2l < 0) | (p2l >= self.num_logical)).any()):
            raise ValueError(f"phy2log holds ids outside [0, {self.num_logical})")
        logcnt = torch.stack([torch.bincount(row, minlength=self.num_logical) for row in p2l]) if L else \
            torch.zeros(0, self.num_logical, dtype=torch.int64)
        if bool((logcnt == 0).any()):
            layer, expert = (logcnt == 0).nonzero()[0].tolist()
            raise ValueError(f"layer {self.layer_ids[layer]}: logical expert {expert} has no physical slot")
        R = int(logcnt.max()) if L else 1
        log2phy = torch.full((L, self.num_logical, R), -1, dtype=torch.int64)
        for li in range(L):
            order = torch.argsort(p2l[li], stable=True)               # slots grouped by logical expert
            starts = torch.cumsum(logcnt[li], 0) - logcnt[li]
            rank_in_group = torch.arange(P) - starts[p2l[li][order]]
            log2phy[li, p2l[li][order], rank_in_group] = order
        object.__setattr__(self, "log2phy", log2phy)
        object.__setattr__(self, "logcnt", logcnt)

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def row(self, layer_id: int) -> int:
        return _row_of(self.layer_ids, layer_id, "placement")

    def replicas(self, layer_id: int, logical: int) -> list[int]:
        """Physical slots holding `logical` in `layer_id`."""
        r = self.log2phy[self.row(layer_id), logical]
        return r[r >= 0].tolist()

    @classmethod
    def initial(cls, layer_ids: Sequence[int], num_logical: int, num_physical: int, ep_size: int) -> "Placement":
        """The layout before any rebalance: slot p holds expert p % num_logical (identity
        without redundant experts; the extra slots replicate experts 0, 1, ...)."""
        if num_physical < num_logical:
            raise ValueError(f"num_physical={num_physical} < num_logical={num_logical}: every expert needs a slot")
        p2l = (torch.arange(num_physical) % num_logical).expand(len(layer_ids), num_physical).clone()
        return cls(tuple(layer_ids), p2l, ep_size, num_logical)

    def to_json(self) -> dict:
        """For the registry (`eplb.placement`): keyed by global layer id."""
        return {"ep_size": self.ep_size, "num_logical": self.num_logical,
                "phy2log": {str(lid): self.phy2log[i].tolist() for i, lid in enumerate(self.layer_ids)}}

    @classmethod
    def from_json(cls, data: Mapping) -> "Placement":
        ids = sorted(int(k) for k in data["phy2log"])
        p2l = torch.tensor([data["phy2log"][str(i)] for i in ids], dtype=torch.int64)
        return cls(tuple(ids), p2l.reshape(len(ids), -1), int(data["ep_size"]), int(data["num_logical"]))


def rank_load(load: torch.Tensor, placement: Placement) -> torch.Tensor:
    """[n_layers, ep_size] tokens per rank, a logical expert's load split evenly over its replicas."""
    load = load.to(torch.float64)
    per_slot = torch.gather(load / placement.logcnt, 1, placement.phy2log)            # [L, P]
    return per_slot.reshape(len(placement.layer_ids), placement.ep_size, -1).sum(-1)


def max_over_mean(rank_loads: torch.Tensor) -> torch.Tensor:
    """Per layer: max rank load / mean rank load (1.0 = perfectly even; 1.0 when idle)."""
    mean = rank_loads.mean(-1)
    return torch.where(mean > 0, rank_loads.max(-1).values / mean.clamp(min=1e-30), torch.ones_like(mean))


# -- the algorithm -------------------------------------------------------------

def _replicate(load: list[float], num_physical: int) -> list[int]:
    """Replica count per logical expert: give each extra slot to the expert whose
    per-replica load is then highest (the hottest one)."""
    cnt = [1] * len(load)
    for _ in range(num_physical - len(load)):
        e = max(range(len(load)), key=lambda i: (load[i] / cnt[i], -i))
        cnt[e] += 1
    return cnt


def _pack(load: list[float], cnt: list[int], ep_size: int, slots: int) -> list[list[int]]:
    """Greedy: replicas by descending load, each to the least-loaded rank with a free
    slot (preferring a rank that does not already hold that expert), then pairwise
    swaps out of the most-loaded rank while they lower it."""
    items = sorted(((load[e] / cnt[e], e) for e in range(len(load)) for _ in range(cnt[e])),
                   key=lambda t: (-t[0], t[1]))
    ranks: list[list[int]] = [[] for _ in range(ep_size)]
    rload = [0.0] * ep_size
    for w, e in items:
        free = [r for r in range(ep_size) if len(ranks[r]) < slots]
        r = min(free, key=lambda r: (e in ranks[r], rload[r], r))
        ranks[r].append(e)
        rload[r] += w
    per = [load[e] / cnt[e] for e in range(len(load))]
    for _ in range(4 * slots * ep_size):
        a = max(range(ep_size), key=lambda r: rload[r])
        best = None
        for b in range(ep_size):
            if b == a:
                continue
            for i, ea in enumerate(ranks[a]):
                for j, eb in enumerate(ranks[b]):
                    d = per[ea] - per[eb]
                    if d <= 0 or ea == eb:
                        continue
                    new_peak = max(rload[a] - d, rload[b] + d)
                    if new_peak < rload[a] - 1e-12 and (best is None or new_peak < best[0]):
                        best = (new_peak, b, i, j, d)
        if best is None:
            break
        _, b, i, j, d = best
        ranks[a][i], ranks[b][j] = ranks[b][j], ranks[a][i]
        rload[a] -= d
        rload[b] += d
    return ranks


def _order_like(old_slots: list[int], new_experts: list[int]) -> list[int]:
    """Order a rank's new experts so those already in a slot stay there (fewer rows to move)."""
    left = sorted(new_experts)
    out: list[int | None] = [None] * len(old_slots)
    for i, e in enumerate(old_slots):
        if e in left:
            out[i] = e
            left.remove(e)
    it = iter(left)
    return [e if e is not None else next(it) for e in out]


def rebalance(load: torch.Tensor, num_physical: int, ep_size: int, *, old: Placement | None = None,
              layer_ids: Sequence[int] | None = None) -> Placement:
    """A placement of `num_physical` slots (`num_physical - n_logical` replicas of the
    hottest experts), `num_physical / ep_size` per rank, balancing the per-rank load.

    load [n_layers, n_logical]: tokens per logical expert (`ExpertLoadCounter.load()`).
    `old` is the current placement (default `Placement.initial`); a layer whose new
    placement would not lower max/mean keeps its old one, so it never gets worse."""
    load = load.detach().to("cpu", torch.float64)
    L, n = load.shape
    if num_physical < n:
        raise ValueError(f"num_physical={num_physical} < {n} logical experts: every expert needs a slot")
    if num_physical % ep_size:
        raise ValueError(f"num_physical={num_physical} is not a multiple of ep_size={ep_size}")
    if old is None:
        old = Placement.initial(tuple(range(L)) if layer_ids is None else layer_ids, n, num_physical, ep_size)
    layer_ids = tuple(old.layer_ids if layer_ids is None else layer_ids)
    if tuple(old.layer_ids) != layer_ids or old.num_logical != n or old.num_physical != num_physical \
            or old.ep_size != ep_size or len(layer_ids) != L:
        raise ValueError(f"old placement (layers {list(old.layer_ids)}, {old.num_logical} logical, "
                         f"{old.num_physical} physical, ep_size={old.ep_size}) does not match the request "
                         f"(layers {list(layer_ids)}, {n} logical, {num_physical} physical, ep_size={ep_size}): "
                         f"changing the slot count needs new expert tensors")
    slots = num_physical // ep_size
    rows = []
    for li in range(L):
        lo = load[li].tolist()
        ranks = _pack(lo, _replicate(lo, num_physical), ep_size, slots)
        old_row = old.phy2log[li].tolist()
        rows.append([e for r in range(ep_size) for e in _order_like(old_row[r * slots:(r + 1) * slots], ranks[r])])
    new_p2l = torch.tensor(rows, dtype=torch.int64).reshape(L, num_physical)
    before = max_over_mean(rank_load(load, old))
    after = max_over_mean(rank_load(load, Placement(layer_ids, new_p2l, ep_size, n)))
    worse = after > before + 1e-12
    new_p2l[worse] = old.phy2log[worse]
    return Placement(layer_ids, new_p2l, ep_size, n, max_over_mean_before=before,
                     max_over_mean_after=torch.where(worse, before, after))


# -- routing and weights ---------------------------------------------------------

def to_physical(topk_ids: torch.Tensor, placement: Placement, layer_id: int) -> torch.Tensor:
    """Logical ids [T, K] -> physical slot ids, replica chosen round-robin by token index.

    Fused shared slots (ids >= num_logical) move to num_physical + s, keeping them
    after the routed slots; negative (masked) ids stay as they are."""
    row = placement.row(layer_id)
    n, P = placement.num_logical, placement.num_physical
    routed = (topk_ids >= 0) & (topk_ids < n)
    e = topk_ids.clamp(0, n - 1)
    cnt = placement.logcnt[row].to(topk_ids.device)[e]                         # [T, K]
    token = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]
    phys = placement.log2phy[row].to(topk_ids.device)[e, token % cnt]
    return torch.where(routed, phys, torch.where(topk_ids >= n, topk_ids - n + P, topk_ids))


def moves(old: Placement, new: Placement, layer_id: int) -> torch.Tensor:
    """Source slot (in `old`) of each slot of `new`, [num_physical]: the slot itself when
    it already holds the right expert, else an old replica on the same EP rank (a local
    copy), else the expert's first old replica. Deterministic: every rank computes the
    same table, so senders and receivers agree without talking."""
    ro, rn = old.row(layer_id), new.row(layer_id)
    want = new.phy2log[rn]                                           # [P]
    P, S = new.num_physical, new.slots_per_rank
    slot = torch.arange(P)
    cands = old.log2phy[ro, want]                                    # [P, R] old replicas, -1 padded
    same_rank = (cands >= 0) & (torch.div(cands, S, rounding_mode="floor") == (slot // S)[:, None])
    local = torch.where(same_rank.any(1), cands.gather(1, same_rank.int().argmax(1, keepdim=True)).squeeze(1),
                        cands[:, 0])
    return torch.where(old.phy2log[ro] == want, slot, local)


def apply_placement(weights_of_layer: Mapping[int, Sequence[torch.Tensor]], old: Placement,
                    new: Placement) -> dict[int, int]:
    """Rearrange expert weights in place from `old` to `new` (single process: every
    tensor holds all `num_physical` slots along dim 0). Returns rows written per layer.

    `weights_of_layer` is the model's `routed_experts_weights_of_layer`: {global layer
    id: [tensors, dim 0 = physical expert]}; its layers must be exactly the placement's.

    Multi-rank, where each rank holds only its slots: `apply_placement_ep`."""
    for what, p in (("old", old), ("new", new)):
        if set(weights_of_layer) != set(p.layer_ids):
            raise KeyError(f"weights cover layers {sorted(weights_of_layer)} but the {what} placement covers "
                           f"{sorted(p.layer_ids)} (EPLB descriptors hold only the local stage's MoE layers)")
    if old.num_physical != new.num_physical or old.num_logical != new.num_logical:
        raise ValueError("old and new placements differ in slot or expert count")
    written = {}
    for layer_id, tensors in weights_of_layer.items():
        src = moves(old, new, layer_id)
        changed = src != torch.arange(new.num_physical)
        for t in tensors:
            if t.shape[0] != new.num_physical:
                raise ValueError(f"layer {layer_id}: tensor of {t.shape[0]} experts along dim 0, placement has "
                                 f"{new.num_physical} physical slots")
            idx = changed.nonzero().squeeze(1).to(t.device)
            with torch.no_grad():
                t[idx] = t.index_select(0, src.to(t.device)[idx])     # reads complete before the write
        written[layer_id] = int(changed.sum())
    return written


def apply_placement_ep(weights_of_layer: Mapping[int, Sequence[torch.Tensor]], old: Placement, new: Placement,
                       group=None) -> dict[int, int]:
    """`apply_placement` on EP ranks: rank r's tensors hold slots [r*S, (r+1)*S) along
    dim 0. A collective over the EP `group` (every rank calls it with the same
    placements). The `moves` table, identical on every rank, says which old slot fills
    each new slot: a source on the same rank is a local copy; otherwise its owner sends
    the rows (one message per peer and tensor, rows in slot order on both sides). All
    old rows are read before any is overwritten. Returns rows written here per layer."""
    import torch.distributed as dist

    ep, me = dist.get_world_size(group), dist.get_rank(group)
    if ep != new.ep_size or ep != old.ep_size:
        raise ValueError(f"placements are for ep_size={new.ep_size}/{old.ep_size}, the group has {ep} ranks")
    for what, p in (("old", old), ("new", new)):
        if set(weights_of_layer) != set(p.layer_ids):
            raise KeyError(f"weights cover layers {sorted(weights_of_layer)} but the {what} placement covers "
                           f"{sorted(p.layer_ids)} (EPLB descriptors hold only the local stage's MoE layers)")
    S = new.slots_per_rank
    written = {}
    for layer_id in sorted(weights_of_layer):          # same order on every rank
        src = moves(old, new, layer_id)
        dst = torch.arange(new.num_physical)
        owner = torch.div(src, S, rounding_mode="floor")
        mine = (dst // S == me) & (src != dst)
        sends = {q: ((dst // S == q) & (src != dst) & (owner == me)).nonzero().squeeze(1) for q in range(ep) if q != me}
        recvs = {q: (mine & (owner == q)).nonzero().squeeze(1) for q in range(ep) if q != me}
        local = (mine & (owner == me)).nonzero().squeeze(1)
        for t in weights_of_layer[layer_id]:
            if t.shape[0] != S:
                raise ValueError(f"layer {layer_id}: tensor of {t.shape[0]} experts along dim 0, this rank has "
                                 f"{S} slots")
            ops, bufs = [], {}
            for q, rows in sends.items():
                if rows.numel():
                    ops.append(dist.P2POp(dist.isend, t.index_select(0, (src[rows] - me * S).to(t.device)).contiguous(),
                                          dist.get_global_rank(group, q) if group is not None else q, group))
            for q, rows in recvs.items():
                if rows.numel():
                    bufs[q] = t.new_empty((rows.numel(), *t.shape[1:]))
                    ops.append(dist.P2POp(dist.irecv, bufs[q], dist.get_global_rank(group, q) if group is not None
                                          else q, group))
            copies = t.index_select(0, (src[local] - me * S).to(t.device))   # read before any write
            for req in (dist.batch_isend_irecv(ops) if ops else []):
                req.wait()
            with torch.no_grad():
                t[(local - me * S).to(t.device)] = copies
                for q, buf in bufs.items():
                    t[(recvs[q] - me * S).to(t.device)] = buf
        written[layer_id] = int(mine.sum())
    return written
