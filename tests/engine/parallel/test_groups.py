"""The (pp, ep, tp) grid: pure rank arithmetic, and on 2 ranks the groups it builds."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.parallel.groups import (ep_group_ranks, grid_coords, grid_position, make_grid, pp_group_ranks,
                                            tp_group_ranks)
from loadplan.engine.parallel.launch import launch


def test_grid_coords_cover_every_rank_once():
    pp, ep = 3, 2
    coords = [grid_coords(r, pp, ep) for r in range(pp * ep)]
    assert sorted(coords) == [(p, e) for p in range(pp) for e in range(ep)]
    for r, (p, e) in enumerate(coords):
        assert r in ep_group_ranks(p, ep) and r in pp_group_ranks(e, pp, ep)
    assert ep_group_ranks(1, ep) == [2, 3]          # a stage's EP ranks are contiguous
    assert pp_group_ranks(1, pp, ep) == [1, 3, 5]


def test_a_stage_keeps_its_tp_ranks_neighbours_and_its_ranks_contiguous():
    pp, ep, tp = 2, 2, 2
    pos = [grid_position(r, pp, ep, tp) for r in range(pp * ep * tp)]
    assert sorted(pos) == [(p, e, t) for p in range(pp) for e in range(ep) for t in range(tp)]
    for r, (p, e, t) in enumerate(pos):
        assert r in ep_group_ranks(p, ep, tp, t) and r in pp_group_ranks(e, pp, ep, tp, t)
        assert r in tp_group_ranks(p, e, ep, tp)
        assert all(4 * p <= m < 4 * (p + 1) for m in ep_group_ranks(p, ep, tp, t) + tp_group_ranks(p, e, ep, tp))
    assert tp_group_ranks(1, 0, ep, tp) == [4, 5]            # a stage's TP ranks are neighbours
    assert ep_group_ranks(1, ep, tp, 1) == [5, 7]
    assert pp_group_ranks(1, pp, ep, tp, 0) == [2, 6]       # pipeline peers are ep * tp ranks apart
    assert [grid_position(r, 3, 2) for r in range(6)] == [(*grid_coords(r, 3, 2), 0) for r in range(6)]


def test_grid_refuses_sizes_that_do_not_fill_the_world():
    with pytest.raises(ValueError, match="must equal the number of ranks"):
        grid_coords(0, 0, 2)
    with pytest.raises(ValueError, match="outside"):
        grid_coords(4, 2, 2)


def _grid_rank(rank, world_size):
    import torch.distributed as dist

    out = {}
    for pp, ep in ((2, 1), (1, 2)):
        g = make_grid(pp, ep)
        t_ep = torch.tensor([float(rank + 1)])
        dist.all_reduce(t_ep, group=g.ep_group)
        t_pp = torch.tensor([float(rank + 1)])
        dist.all_reduce(t_pp, group=g.pp_group)
        out[(pp, ep)] = {"pp_rank": g.pp_rank, "ep_rank": g.ep_rank, "ep_sum": t_ep.item(), "pp_sum": t_pp.item(),
                         "prev": g.prev_stage_rank, "next": g.next_stage_rank}
    return out


def test_groups_reduce_over_their_members_only():
    r0, r1 = launch(2, _grid_rank, timeout_s=60)
    # pp=2, ep=1: each EP group is one rank, the PP group is both
    assert (r0[(2, 1)]["ep_sum"], r1[(2, 1)]["ep_sum"]) == (1.0, 2.0)
    assert (r0[(2, 1)]["pp_sum"], r1[(2, 1)]["pp_sum"]) == (3.0, 3.0)
    assert (r0[(2, 1)]["prev"], r0[(2, 1)]["next"], r1[(2, 1)]["prev"], r1[(2, 1)]["next"]) == (None, 1, 0, None)
    # pp=1, ep=2: the transpose
    assert (r0[(1, 2)]["ep_sum"], r1[(1, 2)]["ep_sum"]) == (3.0, 3.0)
    assert (r0[(1, 2)]["pp_sum"], r1[(1, 2)]["pp_sum"]) == (1.0, 2.0)
    assert (r0[(1, 2)]["ep_rank"], r1[(1, 2)]["ep_rank"]) == (0, 1)
