"""The launcher: results come back in rank order, and any failing rank ends the whole
run with that rank's error instead of a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch

from loadplan.engine.parallel.launch import RankFailed, launch, set_seed


def _sum_ranks(rank, world_size, scale):
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "sum": t.item() * scale}


def test_results_come_back_in_rank_order():
    out = launch(2, _sum_ranks, 10.0, timeout_s=60)
    assert out == [{"rank": 0, "world": 2, "sum": 30.0}, {"rank": 1, "world": 2, "sum": 30.0}]


def _rank1_raises_while_rank0_waits(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on rank one")
    dist.all_reduce(torch.ones(1))      # never completed: rank 1 is gone
    return "unreachable"


def test_exception_on_one_rank_fails_the_run_fast_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(2, _rank1_raises_while_rank0_waits, timeout_s=60)
    assert info.value.rank == 1
    assert "ValueError: boom on rank one" in info.value.error
    assert "_rank1_raises_while_rank0_waits" in info.value.error      # the traceback, not just the message
    assert time.monotonic() - t0 < 45                                 # not the 60 s timeout


def _rank1_exits(rank, world_size):
    if rank == 1:
        os._exit(3)
    time.sleep(60)
    return "unreachable"


def test_nonzero_exit_without_result_fails_the_run():
    with pytest.raises(RankFailed) as info:
        launch(2, _rank1_exits, timeout_s=60)
    assert info.value.rank == 1
    assert "exited with code 3" in info.value.error


def _rank1_hangs(rank, world_size):
    if rank == 1:
        time.sleep(600)
    return rank


def test_hang_past_timeout_names_the_stuck_rank_and_where_it_waits():
    with pytest.raises(RankFailed) as info:
        launch(2, _rank1_hangs, timeout_s=2)
    assert info.value.rank == 1
    assert "timeout_s=2" in info.value.error
    assert "_rank1_hangs" in info.value.error      # its stack, dumped before the kill
    assert info.value.others == {}                 # rank 0 had delivered its result


def test_set_seed_makes_draws_repeatable():
    set_seed(7)
    a = torch.randn(4)
    set_seed(7)
    assert torch.equal(a, torch.randn(4))
    set_seed(8)
    assert not torch.equal(a, torch.randn(4))


def _returns_unpicklable(rank, world_size):
    return lambda: rank


def test_unpicklable_result_is_that_ranks_error():
    with pytest.raises(RankFailed) as info:
        launch(1, _returns_unpicklable, timeout_s=30)
    assert info.value.rank == 0
    assert "pickle" in info.value.error.lower()


def _read_env(rank, world_size, name):
    return os.environ.get(name)


def test_ranks_see_the_callers_current_environment(monkeypatch):
    # the fork server outlives this test: each launch must still hand over the env of its caller
    monkeypatch.setenv("LOADPLAN_LAUNCH_PROBE", "first")
    assert launch(1, _read_env, "LOADPLAN_LAUNCH_PROBE", timeout_s=30) == ["first"]
    monkeypatch.setenv("LOADPLAN_LAUNCH_PROBE", "second")
    assert launch(1, _read_env, "LOADPLAN_LAUNCH_PROBE", timeout_s=30) == ["second"]


def test_spawn_start_method_works_too():
    out = launch(2, _sum_ranks, 1.0, timeout_s=60, start_method="spawn")
    assert [o["sum"] for o in out] == [3.0, 3.0]
