"""EPLB: counting, the placement algorithm, routing to replicas, moving weights."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from loadplan.engine.eplb import (ExpertLoadCounter, Placement, apply_placement, apply_placement_ep, max_over_mean,
                                  moves, rank_load, rebalance, to_physical)


# -- counting --------------------------------------------------------------------

def test_counter_counts_routed_ids_only_per_global_layer():
    c = ExpertLoadCounter(layer_ids=[4, 7], num_logical=5)
    batches = [(4, torch.tensor([[0, 3], [3, 5], [-1, 4]])),     # 5: a fused shared slot; -1: masked
               (7, torch.tensor([[1, 1], [2, 0]])),
               (4, torch.tensor([[3, 2]]))]
    expected = {4: collections.Counter(), 7: collections.Counter()}
    for layer, ids in batches:
        c.record(layer, ids)
        expected[layer].update(i for i in ids.flatten().tolist() if 0 <= i < 5)
    load = c.load()
    for row, layer in enumerate((4, 7)):
        assert load[row].tolist() == [expected[layer][e] for e in range(5)]
    c.reset()
    assert int(c.load().sum()) == 0


def test_counter_refuses_a_layer_of_another_stage():
    c = ExpertLoadCounter(layer_ids=[4, 7], num_logical=5)
    with pytest.raises(KeyError, match="layer 2 is not one of"):
        c.record(2, torch.tensor([[0]]))


# -- the placement ---------------------------------------------------------------

def _skewed(n_layers, n, seed):
    g = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.2
    return torch.stack([(zipf[torch.randperm(n, generator=g)] * 10_000).round() for _ in range(n_layers)])


def _check_well_formed(p: Placement, n, num_physical, ep):
    assert p.phy2log.shape == (len(p.layer_ids), num_physical)
    assert bool((p.logcnt >= 1).all())                                  # every expert has a replica
    assert p.logcnt.sum(1).tolist() == [num_physical] * len(p.layer_ids)
    for li in range(len(p.layer_ids)):
        for e in range(n):
            slots = p.log2phy[li, e][p.log2phy[li, e] >= 0]
            assert len(slots) == p.logcnt[li, e]
            assert bool((p.phy2log[li, slots] == e).all())


def test_rebalance_lowers_max_over_mean_on_skewed_loads():
    n, ep, P = 16, 4, 20
    load = _skewed(3, n, seed=0)
    p = rebalance(load, P, ep, layer_ids=[1, 3, 5])
    _check_well_formed(p, n, P, ep)
    assert p.layer_ids == (1, 3, 5)
    before = max_over_mean(rank_load(load, Placement.initial([1, 3, 5], n, P, ep)))
    torch.testing.assert_close(p.max_over_mean_before, before)
    torch.testing.assert_close(p.max_over_mean_after, max_over_mean(rank_load(load, p)))
    assert bool((p.max_over_mean_after < p.max_over_mean_before).all())
    # the hottest expert of each layer got the redundant slots' first replica
    for li in range(3):
        assert p.logcnt[li, int(load[li].argmax())] >= 2


def test_rebalance_never_worsens_and_stays_well_formed_on_random_loads():
    rng = random.Random(1)
    for _ in range(40):
        ep = rng.choice([1, 2, 4])
        n = ep * rng.randint(1, 5)
        P = n + ep * rng.randint(0, 2)
        load = torch.tensor([[float(rng.choice([0, 1, 5, 100, rng.randint(0, 1000)])) for _ in range(n)]
                             for _ in range(2)])
        p = rebalance(load, P, ep)
        _check_well_formed(p, n, P, ep)
        assert bool((p.max_over_mean_after <= p.max_over_mean_before + 1e-9).all()), (load, P, ep)
        # and from a non-initial placement as the starting point
        q = rebalance(load.flip(1), P, ep, old=p)
        assert bool((q.max_over_mean_after <= max_over_mean(rank_load(load.flip(1), p)) + 1e-9).all())


def test_rebalance_refuses_a_changed_slot_count_or_too_few_slots():
    load = _skewed(1, 8, seed=2)
    with pytest.raises(ValueError, match="every expert needs a slot"):
        rebalance(load, 6, 2)
    with pytest.raises(ValueError, match="multiple of ep_size"):
        rebalance(load, 9, 2)
    with pytest.raises(ValueError, match="changing the slot count"):
        rebalance(load, 10, 2, old=Placement.initial([0], 8, 8, 2))


def test_placement_survives_json():
    p = rebalance(_skewed(2, 8, seed=3), 10, 2, layer_ids=[6, 9])
    q = Placement.from_json(p.to_json())
    assert q.layer_ids == p.layer_ids and torch.equal(q.phy2log, p.phy2log) and q.ep_size == 2


# -- routing -----------------------------------------------------------------------

def test_to_physical_picks_replicas_of_the_same_expert_round_robin():
    n, P = 4, 6
    p = Placement((0,), torch.tensor([[0, 1, 2, 3, 0, 0]]), ep_size=2, num_logical=n)
    ids = torch.tensor([[0, 2, 4, -1]] * 6)                 # 4 = fused shared slot, -1 = masked
    phys = to_physical(ids, p, 0)
    assert sorted(phys[:, 0].tolist()) == [0, 0, 4, 4, 5, 5]   # 3 replicas, 6 tokens: each used twice
    assert bool((p.phy2log[0, phys[:, 0]] == 0).all())
    assert phys[:, 1].tolist() == [2] * 6
    assert phys[:, 2].tolist() == [P] * 6                   # fused slot s -> num_physical + s
    assert phys[:, 3].tolist() == [-1] * 6


# -- weights ---------------------------------------------------------------------

def test_apply_placement_moves_exactly_the_rows_whose_expert_changed():
    n, P, ep = 6, 8, 2
    old = Placement.initial([2], n, P, ep)
    new = rebalance(_skewed(1, n, seed=4), P, ep, old=old, layer_ids=[2])
    assert not torch.equal(old.phy2log, new.phy2log)
    # column 0: the expert a row holds; column 1: the slot the row started in
    w = torch.stack([old.phy2log[0].double(), torch.arange(P, dtype=torch.float64)], 1)
    original = w.clone()
    written = apply_placement({2: [w]}, old, new)
    changed = (old.phy2log[0] != new.phy2log[0])
    assert written == {2: int(changed.sum())}
    assert torch.equal(w[:, 0], new.phy2log[0].double())                 # each slot holds its new expert
    assert torch.equal(w[~changed], original[~changed])                  # untouched rows stay put
    for slot in changed.nonzero().squeeze(1).tolist():                   # moved rows come from a replica
        src = int(w[slot, 1])
        assert old.phy2log[0, src] == new.phy2log[0, slot]


def test_apply_placement_refuses_layers_outside_the_placement():
    old = Placement.initial([2], 4, 4, 2)
    new = rebalance(_skewed(1, 4, seed=5), 4, 2, old=old)
    with pytest.raises(KeyError, match="local stage"):
        apply_placement({2: [torch.zeros(4, 1)], 3: [torch.zeros(4, 1)]}, old, new)


def _toy_moe(x, phys_ids, weights, w_phys):
    """Each physical slot p is a linear map w_phys[p]; out[t] = sum_k weights[t, k] * x[t] @ w_phys[id]."""
    return torch.einsum("tk,tkd->td", weights, torch.einsum("td,tkde->tke", x, w_phys[phys_ids]))


def test_toy_moe_gives_identical_outputs_after_rebalance():
    torch.manual_seed(0)
    n, P, ep, D, T, K = 8, 10, 2, 4, 64, 2
    w_logical = torch.randn(n, D, D)
    old = Placement.initial([3], n, P, ep)
    w_phys = w_logical[old.phy2log[0]].clone()                 # what the loader put in the slots
    x = torch.randn(T, D)
    bias = torch.tensor([3.0, 2.0] + [0.0] * (n - 2))           # a skewed router
    logits = torch.randn(T, n) + bias
    weights, ids = torch.softmax(logits, -1).topk(K, dim=-1)

    counter = ExpertLoadCounter([3], n)
    counter.record(3, ids)
    y_old = _toy_moe(x, to_physical(ids, old, 3), weights, w_phys)

    new = rebalance(counter.load(), P, ep, old=old, layer_ids=[3])
    assert not torch.equal(new.phy2log, old.phy2log)
    assert new.max_over_mean_after[0] < new.max_over_mean_before[0]
    apply_placement({3: [w_phys]}, old, new)
    y_new = _toy_moe(x, to_physical(ids, new, 3), weights, w_phys)
    torch.testing.assert_close(y_new, y_old, rtol=0, atol=0)


# -- on 2 EP ranks: a2a path, counts summed over ranks, weights exchanged ------------

N_LOG, N_PHYS, EP, DIM, LAYER = 8, 10, 2, 4, 3


def _ep_rank(rank, world_size):
    from loadplan.engine.parallel.a2a import combine, dispatch

    S = N_PHYS // EP
    torch.manual_seed(0)
    w_logical = torch.randn(N_LOG, DIM, DIM)                          # the checkpoint, same on every rank
    old = Placement.initial([LAYER], N_LOG, N_PHYS, EP)
    shard = w_logical[old.phy2log[0, rank * S:(rank + 1) * S]].clone()
    torch.manual_seed(100 + rank)                                      # each rank routes its own tokens
    x = torch.randn(32 + 8 * rank, DIM)
    hot = torch.tensor([0.0, 0.0, 4.0, 3.0] + [0.0] * (N_LOG - 4))    # experts 2 and 3, both on rank 0
    logits = torch.randn(x.shape[0], N_LOG) + hot
    weights, ids = torch.softmax(logits, -1).topk(2, dim=-1)

    def moe(placement):
        rx, rids, _, h = dispatch(x, to_physical(ids, placement, LAYER), weights, S, num_routed=N_PHYS)
        return combine(torch.einsum("nd,nde->ne", rx, shard[rids]), h)

    counter = ExpertLoadCounter([LAYER], N_LOG)
    counter.record(LAYER, ids)
    y_old = moe(old)
    counter.all_reduce()
    new = rebalance(counter.load(), N_PHYS, EP, old=old, layer_ids=[LAYER])
    written = apply_placement_ep({LAYER: [shard]}, old, new)
    return {"ref": _toy_moe(x, ids, weights, w_logical), "y_old": y_old, "y_new": moe(new), "shard": shard,
            "w_logical": w_logical, "new": new.to_json(), "written": written[LAYER],
            "before": float(new.max_over_mean_before[0]), "after": float(new.max_over_mean_after[0])}


def test_ep_rebalance_moves_shards_and_keeps_outputs():
    from loadplan.engine.parallel.launch import launch

    results = launch(EP, _ep_rank, timeout_s=60)
    S = N_PHYS // EP
    new = Placement.from_json(results[0]["new"])
    assert results[1]["new"] == results[0]["new"]                     # every rank computed the same placement
    assert results[0]["after"] < results[0]["before"]
    src = moves(Placement.initial([LAYER], N_LOG, N_PHYS, EP), new, LAYER)
    assert bool((src // S != torch.arange(N_PHYS) // S).any())         # some rows crossed ranks
    assert sum(r["written"] for r in results) == int((src != torch.arange(N_PHYS)).sum())
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["y_old"], r["ref"])
        torch.testing.assert_close(r["y_new"], r["y_old"], rtol=0, atol=0)
        assert torch.equal(r["shard"], r["w_logical"][new.phy2log[0, rank * S:(rank + 1) * S]])
