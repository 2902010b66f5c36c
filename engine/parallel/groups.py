"""The (pp, ep) grid of world ranks and its process groups.

    world rank = pp_rank * ep_size + ep_rank

so the EP ranks of one pipeline stage are contiguous (they exchange tokens every MoE
layer: keep them close), and rank r's pipeline peers are r +- ep_size.

`grid_coords` and the `*_ranks` helpers are pure (the launcher and tests use them
without a process group). `make_grid` creates the groups: torch.distributed requires
every rank to create every group, in the same order, so it builds all of them on
each rank and keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def check_sizes(world_size: int, pp_size: int, ep_size: int) -> None:
    if pp_size < 1 or ep_size < 1 or pp_size * ep_size != world_size:
        raise ValueError(f"pp_size={pp_size} x ep_size={ep_size} must equal the number of ranks ({world_size})")


def grid_coords(rank: int, pp_size: int, ep_size: int) -> tuple[int, int]:
    """World rank -> (pp_rank, ep_rank)."""
    check_sizes(pp_size * ep_size, pp_size, ep_size)
    if not 0 <= rank < pp_size * ep_size:
        raise ValueError(f"rank {rank} outside a {pp_size}x{ep_size} grid")
    return rank // ep_size, rank % ep_size


def ep_group_ranks(pp_rank: int, ep_size: int) -> list[int]:
    """World ranks of pipeline stage `pp_rank`'s EP group, in EP-rank order."""
    return [pp_rank * ep_size + e for e in range(ep_size)]


def pp_group_ranks(ep_rank: int, pp_size: int, ep_size: int) -> list[int]:
    """World ranks holding EP rank `ep_rank` on each stage, in stage order."""
    return [p * ep_size + ep_rank for p in range(pp_size)]


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

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_stage_rank(self) -> int | None:
        """World rank this rank receives hidden states from (None on the first stage)."""
        return None if self.is_first_stage else self.rank - self.ep_size

    @property
    def next_stage_rank(self) -> int | None:
        """World rank this rank sends hidden states to (None on the last stage)."""
        return None if self.is_last_stage else self.rank + self.ep_size


def make_grid(pp_size: int, ep_size: int, timeout=None) -> Grid:
    """Create every EP and PP group (a collective: all ranks call it) and return this rank's.

    `timeout` (a timedelta) bounds every collective on the groups; default: the launch's
    (launch.collective_timeout()), else torch's default."""
    import torch.distributed as dist

    from .launch import collective_timeout

    timeout = timeout if timeout is not None else collective_timeout()

    rank, world = dist.get_rank(), dist.get_world_size()
    check_sizes(world, pp_size, ep_size)
    pp_rank, ep_rank = grid_coords(rank, pp_size, ep_size)
    ep_group = pp_group = None
    for p in range(pp_size):
        g = dist.new_group(ep_group_ranks(p, ep_size), timeout=timeout)
        if p == pp_rank:
            ep_group = g
    for e in range(ep_size):
        g = dist.new_group(pp_group_ranks(e, pp_size, ep_size), timeout=timeout)
        if e == ep_rank:
            pp_group = g
    return Grid(rank=rank, world_size=world, pp_size=pp_size, ep_size=ep_size, pp_rank=pp_rank, ep_rank=ep_rank,
                ep_group=ep_group, pp_group=pp_group, ep_ranks=tuple(ep_group_ranks(pp_rank, ep_size)),
                pp_ranks=tuple(pp_group_ranks(ep_rank, pp_size, ep_size)))
