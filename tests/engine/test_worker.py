"""The multi-rank worker (engine/worker.py) on 2 gloo ranks with the real registry (embedded, SQLite):
EPLB rebalancing recorded as plan history, all ranks agreeing on the deployment-wide decisions, a draft
that cannot touch its target's plan, and failures that end the run with the failing rank's error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loadplan.engine.generate import checkpoint_eos, generate
from loadplan.engine.loader import load_model
from loadplan.engine.parallel.launch import RankFailed, launch
from loadplan.engine.worker import WorkerSpec, generate_distributed, run_rank
from loadplan.plan import Keys, Runtime
from loadplan.service.embedded import EmbeddedRegistry

from engine_helpers import LocalRegistry, load_kwargs, make_checkpoint

pytestmark = pytest.mark.heavy(17)

QWEN3, QWEN2 = "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"
SKEWED = (7,) * 10      # one token repeated: every position routes to the same experts in every layer


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("q3"), QWEN3))


@pytest.fixture
def db_url(tmp_path):
    return f"sqlite:///{tmp_path / 'loadplan.db'}"


def _greedy(path, prompt, n, *, eos=True, **kw):
    model = load_model(path, registry=LocalRegistry(), **load_kwargs(**kw))
    return generate(model, list(prompt), n, eos_token_id=(checkpoint_eos(path) or None) if eos else None)[0].tolist()


def test_ep_run_rebalances_with_redundant_experts_and_records_each_placement(qwen3, db_url):
    with EmbeddedRegistry(db_url) as reg:
        spec = WorkerSpec(model=qwen3, prompt_ids=SKEWED, max_new_tokens=6, ep_size=2,
                          registry=reg.address, runtime=Runtime(enable_eplb=True, ep_num_redundant_experts=2),
                          rebalance_every=3,
                          stop_at_eos=False)
        out = generate_distributed(spec, 2, timeout_s=180)    # every rank asks the one registry
    assert out["tokens"] == _greedy(qwen3, SKEWED, 6, eos=False)
    for rank, reports in out["eplb"].items():
        assert len(reports) == 2                              # prefill + 5 decode forwards, every 3 forwards
        first = reports[0]
        assert first["max_over_mean_after"] < first["max_over_mean_before"], "the skewed load must get more even"
        assert all(r["max_over_mean_after"] <= r["max_over_mean_before"] + 1e-9 for r in reports)
        assert [r["revision"] for r in reports] == list(range(len(reports)))
    with EmbeddedRegistry(db_url) as reg, reg.client() as client:
        plans = list(client.iter_plans(deployment_id=out["deployment"]))
        assert sorted(p.plan_id for p in plans) == sorted(out["plan_ids"])
        wide = [{k: d.value for k, d in p.decisions.items() if d.deployment_wide} for p in plans]
        assert wide[0] == wide[1] and wide[0][Keys.EPLB_NUM_PHYSICAL_EXPERTS] == 10
        for rank, plan_id in enumerate(out["plan_ids"]):
            plan = client.get_plan(plan_id, include_history=True)
            revisions = [d for d in plan.history if d.key == Keys.EPLB_PLACEMENT]
            assert [d.revision for d in revisions] == list(range(len(out["eplb"][rank])))
            assert plan.decisions[Keys.EPLB_PLACEMENT].value == revisions[-1].value
            assert set(revisions[-1].value["phy2log"]) == {"0", "1", "2"}   # this runner's MoE layers


def _eplb_logits(rank, world_size, path, db_address, ids):
    """Per backend (normal, a2a): logits, a skewed load, a recorded rebalance, logits again."""
    from loadplan.client import RegistryClient
    from loadplan.engine.rebalance import rebalance
    from loadplan.engine.worker import init_rank, load_runner

    grid, out = None, {}
    with RegistryClient(db_address) as client:
        for backend in ("none", "mori"):
            spec = WorkerSpec(model=path, prompt_ids=(), max_new_tokens=0, ep_size=world_size,
                              registry=db_address, deployment=f"eplb-{backend}",
                              runtime=Runtime(a2a_backend=backend, enable_eplb=True, ep_num_redundant_experts=2))
            grid = grid or init_rank(spec)
            model = load_runner(spec, grid)
            with torch.no_grad():
                before = model(ids)
                model(torch.tensor([SKEWED]))
                report = rebalance(model, recorder=client)
                after = model(ids)
            out[backend] = dict(before=before, after=after, summary=report.summary(), plan_id=model.plan.plan_id)
    return out


def test_ep_rebalance_moves_experts_across_ranks_and_keeps_the_logits(qwen3, db_url):
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(9))
    with EmbeddedRegistry(db_url) as reg:
        results = launch(2, _eplb_logits, qwen3, reg.address, ids, timeout_s=180)
        with reg.client() as client:
            for backend in ("none", "mori"):
                for r in results:
                    case = r[backend]
                    assert (case["after"] - case["before"]).abs().max().item() <= 1e-5
                    s = case["summary"]
                    assert s["max_over_mean_after"] < s["max_over_mean_before"] and s["rows_moved"] > 0
                    plan = client.get_plan(case["plan_id"], include_history=True)
                    assert [d.revision for d in plan.history if d.key == Keys.EPLB_PLACEMENT] == [0]
                # counts were summed over EP: both ranks computed the same placement
                assert results[0][backend]["summary"]["per_layer_after"] == \
                    results[1][backend]["summary"]["per_layer_after"]


def test_draft_with_another_fusion_intent_never_changes_the_target(tmp_path_factory, tmp_path, db_url):
    target = str(make_checkpoint(tmp_path_factory.mktemp("q2t"), QWEN2, seed=0))
    draft = str(make_checkpoint(tmp_path_factory.mktemp("q2d"), QWEN2, seed=1))
    cache = str(tmp_path / "wc")         # one weight-cache flag for everyone, as the CLI passes it
    with EmbeddedRegistry(db_url) as reg:
        spec = WorkerSpec(model=target, prompt_ids=(3, 1, 4, 1, 5), max_new_tokens=6, ep_size=2,
                          registry=reg.address, draft=draft, num_draft_tokens=3, weight_cache=cache,
                          draft_runtime=Runtime(disable_shared_experts_fusion=True))
        out = generate_distributed(spec, 2, timeout_s=180)
    # each runner (rank x role) holds other tensors: one cache file each, never one shared
    assert sorted(f.name for f in tmp_path.glob("wc.*")) == \
        ["wc.speculative.rank0", "wc.speculative.rank1", "wc.target.rank0", "wc.target.rank1"]
    assert out["tokens"] == _greedy(target, spec.prompt_ids, 6)       # exactly the target's greedy tokens
    assert 0.0 <= out["acceptance_rate"] <= 1.0
    with EmbeddedRegistry(db_url) as reg, reg.client() as client:
        plans = {p.plan_id: p for p in client.iter_plans(deployment_id=out["deployment"])}
        for pid in out["plan_ids"]:
            d = plans[pid].decisions
            assert plans[pid].request.role == "target"
            assert d[Keys.SHARED_EXPERTS_FUSION].value is True and d[Keys.FUSED_SHARED_EXPERT_SCALE].value == 0.5
        for pid in out["draft_plan_ids"]:
            assert plans[pid].request.role == "speculative"
            assert plans[pid].decisions[Keys.SHARED_EXPERTS_FUSION].value is False


def _disagreeing_rank(rank, world_size, spec):
    if rank == 1:   # the same deployment, but this rank asks for another backend
        spec = dataclasses.replace(spec, runtime=Runtime(a2a_backend="mori"))
    return run_rank(rank, world_size, spec)


def test_a_rank_with_other_inputs_fails_the_run_with_its_own_error(qwen3, db_url):
    with EmbeddedRegistry(db_url) as reg:
        spec = WorkerSpec(model=qwen3, prompt_ids=(1, 2), max_new_tokens=2, ep_size=2, registry=reg.address,
                          deployment="disagree")
        with pytest.raises(RankFailed) as e:
            launch(2, _disagreeing_rank, spec, timeout_s=120)
    assert e.value.rank == 1
    assert "FAILED_PRECONDITION" in e.value.error and "a2a_backend" in e.value.error


def test_an_unreachable_registry_fails_the_run(qwen3):
    spec = WorkerSpec(model=qwen3, prompt_ids=(1, 2), max_new_tokens=2, ep_size=2, registry="127.0.0.1:9")
    with pytest.raises(RankFailed) as e:
        generate_distributed(spec, 2, timeout_s=120)
    assert "UNAVAILABLE" in e.value.error


def test_ranks_without_a_registry_address_are_refused_before_any_launch(qwen3):
    spec = WorkerSpec(model=qwen3, prompt_ids=(1, 2), max_new_tokens=2, ep_size=2)
    with pytest.raises(ValueError, match=r"WorkerSpec.registry: the ranks are processes of their own"):
        generate_distributed(spec, 2, timeout_s=10)
