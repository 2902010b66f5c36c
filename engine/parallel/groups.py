"""The (pp, ep, tp) grid of world ranks and its process groups.

    world rank = (pp_rank * ep_size + ep_rank) * tp_size + tp_rank

so the ranks of one pipeline stage are contiguous (they exchange activations every
layer: keep them close), a stage's TP ranks are neighbours within it, and rank r's
pipeline peers are r +- ep_size * tp_size. With tp_size 1 this is the (pp, ep) grid
`pp_rank * ep_size + ep_rank`.

`grid_position`, `grid_coords` and the `*_ranks` helpers are pure (the launcher and
tests use them without a process group). `make_grid` creates the groups: torch.distributed
requires every rank to create every group, in the same order, so it builds all of them
on each rank and keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def check_sizes(world_size: int, pp_size: int, ep_size: int, tp_size: int = 1) -> None:
    if pp_size < 1 or ep_size < 1 or tp_size < 1 or pp_size * ep_size * tp_size != world_size:
        sizes = f"pp_size={pp_size} x ep_size={ep_size}" + (f" x tp_size={tp_size}" if tp_size != 1 else "")
        raise ValueError(f"{sizes} must equal the number of ranks ({world_size})")


def grid_position(rank: int, pp_size: int, ep_size: int, tp_size: int = 1) -> tuple[int, int, int]:
    """World rank -> (pp_rank, ep_rank, tp_rank)."""
    check_sizes(pp_size * ep_size * tp_size, pp_size, ep_size, tp_size)
    if not 0 <= rank < pp_size * ep_size * tp_size:
        raise ValueError(f"rank {rank} outside a {pp_size}x{ep_size}x{tp_size} grid")
    return rank // (ep_size * tp_size), rank // tp_size % ep_size, rank % tp_size


def grid_coords(rank: int, pp_size: int, ep_size: int) -> tuple[int, int]:
    """World rank -> (pp_rank, ep_rank) of a grid without tensor parallelism."""
    return grid_position(rank, pp_size, ep_size)[:2]


def _rank(pp_rank: int, ep_rank: int, tp_rank: int, ep_size: int, tp_size: int) -> int:
    return (pp_rank * ep_size + ep_rank) * tp_size + tp_rank


def ep_group_ranks(pp_rank: int, ep_size: int, tp_size: int = 1, tp_rank: int = 0) -> list[int]:
    """World ranks of stage `pp_rank`'s EP group holding TP rank `tp_rank`, in EP-rank order."""
    return [_rank(pp_rank, e, tp_rank, ep_size, tp_size) for e in range(ep_size)]


def pp_group_ranks(ep_rank: int, pp_size: int, ep_size: int, tp_size: int = 1, tp_rank: int = 0) -> list[int]:
    """World ranks holding (EP rank `ep_rank`, TP rank `tp_rank`) on each stage, in stage order."""
    return [_rank(p, ep_rank, tp_rank, ep_size, tp_size) for p in range(pp_size)]


def tp_group_ranks(pp_rank: int, ep_rank: int, ep_size: int, tp_size: int) -> list[int]:
    """World ranks of the TP group of (stage `pp_rank`, EP rank `ep_rank`), in TP-rank order."""
    return [_rank(pp_rank, ep_rank, t, ep_size, tp_size) for t in range(tp_size)]


@dataclass(frozen=True)
class Grid:
    """This rank's place in the grid and its groups."""

    rank: int
    world_size: int
    pp_size: int
    ep_size: int
    pp_rank: int
    ep_rank: int
    ep_group: Any          # torch.distributed ProcessGroup over ep_ranks
    pp_group: Any          # torch.distributed ProcessGroup over pp_ranks
    ep_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None   # torch.distributed ProcessGroup over tp_ranks
    tp_ranks: tuple[int, ...] = ()
    stage_group: Any = None  # over every rank of this stage (made when both ep_size and tp_size are > 1)

    @property
    def experts_group(self) -> Any:
        """The ranks a MoE layer's experts are split over (by expert and/or by feature), whose partial
        sums the normal path's all-reduce adds up: EP, TP, or both (the stage)."""
        if self.ep_size > 1 and self.tp_size > 1:
            return self.stage_group
        return self.tp_group if self.tp_size > 1 else self.ep_group

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_stage_rank(self) -> int | None:
        """World rank this rank receives hidden states from (None on the first stage)."""
        return None if self.is_first_stage else self.rank - self.ep_size * self.tp_size

    @property
    def next_stage_rank(self) -> int | None:
        """World rank this rank sends hidden states to (None on the last stage)."""
        return None if self.is_last_stage else self.rank + self.ep_size * self.tp_size


def make_grid(pp_size: int, ep_size: int, tp_size: int = 1, timeout=None) -> Grid:
    """Create every EP, PP, TP (and stage) group (a collective: all ranks call it) and return this rank's.

    `timeout` (a timedelta) bounds every collective on the groups; default: the launch's
    (launch.collective_timeout()), else torch's default."""
    import torch.distributed as dist

    from .launch import collective_timeout

    timeout = timeout if timeout is not None else collective_timeout()

    rank, world = dist.get_rank(), dist.get_world_size()
    check_sizes(world, pp_size, ep_size, tp_size)
    pp_rank, ep_rank, tp_rank = grid_position(rank, pp_size, ep_size, tp_size)
    mine = {}
    for p in range(pp_size):
        for t in range(tp_size):
            g = dist.new_group(ep_group_ranks(p, ep_size, tp_size, t), timeout=timeout)
            if (p, t) == (pp_rank, tp_rank):
                mine["ep"] = g
    for e in range(ep_size):
        for t in range(tp_size):
            g = dist.new_group(pp_group_ranks(e, pp_size, ep_size, tp_size, t), timeout=timeout)
            if (e, t) == (ep_rank, tp_rank):
                mine["pp"] = g
    if tp_size > 1:     # no groups of one rank to make (nor to wait on) for the common case
        for p in range(pp_size):
            for e in range(ep_size):
                g = dist.new_group(tp_group_ranks(p, e, ep_size, tp_size), timeout=timeout)
                if (p, e) == (pp_rank, ep_rank):
                    mine["tp"] = g
    if tp_size > 1 and ep_size > 1:
        for p in range(pp_size):
            g = dist.new_group(list(range(p * ep_size * tp_size, (p + 1) * ep_size * tp_size)), timeout=timeout)
            if p == pp_rank:
                mine["stage"] = g
    return Grid(rank=rank, world_size=world, pp_size=pp_size, ep_size=ep_size, pp_rank=pp_rank, ep_rank=ep_rank,
                ep_group=mine["ep"], pp_group=mine["pp"],
                ep_ranks=tuple(ep_group_ranks(pp_rank, ep_size, tp_size, tp_rank)),
                pp_ranks=tuple(pp_group_ranks(ep_rank, pp_size, ep_size, tp_size, tp_rank)),
                tp_size=tp_size, tp_rank=tp_rank, tp_group=mine.get("tp"),
                tp_ranks=tuple(tp_group_ranks(pp_rank, ep_rank, ep_size, tp_size)), stage_group=mine.get("stage"))
