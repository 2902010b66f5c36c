"""The multi-rank worker: every rank builds its runner(s) from its own plan and decodes in lockstep.

    result = generate_distributed(WorkerSpec(model=DIR, prompt_ids=[...], max_new_tokens=8, ep_size=2,
                                             registry="HOST:PORT"), nproc=2)

`generate_distributed` (the parent) takes the address of the ONE registry all ranks ask
(so they share its deployment pins: `loadplan generate` starts the embedded one when it is
given none), makes a fresh deployment id when none is given, and launches the
ranks (engine/parallel/launch.py: every collective has a timeout; the first rank
that fails makes the run raise `RankFailed` with that rank's error, never hang).

`run_rank` (each rank):
1. the (pp, ep, tp) grid and its groups, set as the process's parallel context BEFORE
   any model is built (engine/parallel/context.py): the MoE layers take their EP
   group from it at construction, the TP-split layers their TP group;
2. `load_model` (the single instantiation point) for the target, role "target":
   the rank resolves its OWN plan under the deployment id. Rank 0 resolves first
   and the others after it, so the deployment is pinned by rank 0's inputs and a
   rank whose inputs differ is the one refused (FAILED_PRECONDITION), not rank 0;
3. with a draft, the same for it (role "speculative", the same parallel layout,
   its own runtime flags): its own plan, so it can never rewrite the target's;
4. each stage wrapped as a whole model (engine/parallel/pipeline.py: hidden states
   between stages, logits broadcast from the last stage so every rank samples the
   same token);
5. greedy decoding (engine/generate.py) or `speculative_generate` with the draft;
6. EPLB (plan eplb.enabled): a rebalance every `rebalance_every` target forwards, or
   once after decoding when 0 (engine/rebalance.py), each recorded in the registry.
"""

from __future__ import annotations

import dataclasses
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from loadplan.plan import Parallel, Runtime


@dataclass(frozen=True)
class WorkerSpec:
    model: str                                  # target checkpoint folder
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    ep_size: int = 1
    pp_size: int = 1
    tp_size: int = 1
    deployment: str | None = None               # None: generate_distributed makes a fresh one for its ranks
    registry: str | None = None                 # the registry's address (None: `load_runner` is handed one)
    runtime: Runtime = Runtime()                # what the target asks the registry with (its EPLB too)
    quantization: str | None = None             # both runners' explicit quantization (None: their checkpoints')
    weight_cache: str | None = None             # a path prefix: one cache file per runner and rank
    draft: str | None = None                    # draft checkpoint folder (speculative decoding)
    num_draft_tokens: int = 4
    draft_runtime: Runtime | None = None        # the draft's (None: the target's without EPLB)
    rebalance_every: int = 0                    # target forwards between rebalances; 0: once after decoding
    dtype: str = "float32"
    stop_at_eos: bool = True                    # stop at the checkpoint's EOS ids, as `loadplan generate` does

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))   # any sequence in
        draft = self.draft_runtime
        if draft is not None and (draft.enable_eplb or draft.ep_num_redundant_experts):
            raise ValueError("WorkerSpec.draft_runtime: EPLB is the target's (the worker rebalances the target only)")
        if draft is not None and draft.a2a_backend != self.runtime.a2a_backend:
            raise ValueError(f"WorkerSpec.draft_runtime: a2a_backend {draft.a2a_backend!r}; the draft runs on the "
                             f"target's ({self.runtime.a2a_backend!r})")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not hasattr(torch, self.dtype) or not isinstance(getattr(torch, self.dtype), torch.dtype):
            raise ValueError(f"dtype {self.dtype!r} is not a torch dtype")


# -- one rank ------------------------------------------------------------------------

def init_rank(spec: WorkerSpec):
    """Create the grid (a collective) and make it the parallel context of the models built next."""
    from .parallel.context import ParallelContext, set_parallel_context
    from .parallel.groups import make_grid

    grid = make_grid(spec.pp_size, spec.ep_size, spec.tp_size)
    set_parallel_context(ParallelContext(grid))
    return grid


def load_runner(spec: WorkerSpec, grid, role: str = "target", *, registry: Any = None):
    """Build this rank's stage of the target (or the draft, role "speculative") from its own plan,
    wrapped so it runs like the whole model. Rank 0 resolves first (see the module doc)."""
    import torch.distributed as dist

    from .checkpoint import read_config
    from .loader import load_model
    from .parallel.launch import rank_device
    from .parallel.pipeline import PipelineDraft, PipelineModel

    draft = role != "target"
    path = spec.draft if draft else spec.model
    # A draft that drafts from the target's final hidden states runs where they are: with pipeline stages, on
    # the last stage's ranks only, as a runner of one stage (its plan says pp_size 1).
    config = read_config(path) if draft and spec.pp_size > 1 else None
    on_last_stage = config is not None and _drafts_from_target_hidden(config)
    parallel = Parallel(tp_size=spec.tp_size, tp_rank=grid.tp_rank, ep_size=spec.ep_size, ep_rank=grid.ep_rank,
                        pp_size=1 if on_last_stage else spec.pp_size, pp_rank=0 if on_last_stage else grid.pp_rank)
    runtime = spec.runtime
    if draft:
        runtime = spec.draft_runtime or dataclasses.replace(runtime, enable_eplb=False, ep_num_redundant_experts=0)
    # One cache file per runner: ranks (and target vs draft) hold different tensors.
    cache = f"{spec.weight_cache}.{role}.rank{grid.rank}" if spec.weight_cache else None
    kwargs = dict(registry=registry if registry is not None else spec.registry, role=role,
                  deployment=spec.deployment, quantization=spec.quantization, device=rank_device(),
                  dtype=getattr(torch, spec.dtype), weight_cache=cache)
    builds = grid.is_last_stage or not on_last_stage
    first = (grid.pp_size - 1) * grid.ep_size * grid.tp_size if on_last_stage else 0   # its first builder
    distributed = dist.is_initialized() and grid.world_size > 1
    model = None
    if grid.rank == first:
        model = load_model(path, parallel, runtime, **kwargs)
    if distributed:
        dist.barrier()          # the first rank pinned the deployment (or failed: then the launcher stops everyone)
    if grid.rank != first and builds:
        model = load_model(path, parallel, runtime, **kwargs)
    if on_last_stage:
        return PipelineDraft(model, grid, config["vocab_size"])
    return PipelineModel(model, grid)


def _drafts_from_target_hidden(config: dict) -> bool:
    """Does the engine class of a checkpoint's config.json draft from a target's hidden states (a NextN draft)?"""
    from .registry import UnsupportedModel, model_class

    archs = config.get("architectures") or [None]
    try:
        return bool(getattr(model_class(archs[0]), "drafts_from_target_hidden", False))
    except UnsupportedModel:   # load_model refuses it, with the registry's message
        return False


def _recorder(spec: WorkerSpec, stack: ExitStack):
    if spec.registry is None:
        return None
    from loadplan.client import RegistryClient

    return stack.enter_context(RegistryClient(spec.registry))


def run_rank(rank: int, world_size: int, spec: WorkerSpec) -> dict:
    """One rank of `generate_distributed` (a launch target: fn(rank, world_size, spec))."""
    from .generate import checkpoint_eos, generate
    from .rebalance import rebalance

    grid = init_rank(spec)
    target = load_runner(spec, grid, "target")
    draft = load_runner(spec, grid, "speculative") if spec.draft else None
    eos = checkpoint_eos(spec.model) if spec.stop_at_eos else []
    out: dict[str, Any] = {"rank": rank, "pp_rank": grid.pp_rank, "ep_rank": grid.ep_rank, "tp_rank": grid.tp_rank,
                           "plan_id": target.plan.plan_id,
                           # None without a draft, and on ranks that hold none (PipelineDraft: earlier stages)
                           "draft_plan_id": draft.plan.plan_id if draft is not None and draft.plan else None,
                           "acceptance_rate": None, "proposed": None, "accepted": None, "eplb": []}
    with ExitStack() as stack:
        recorder = _recorder(spec, stack)
        eplb_on = bool(spec.runtime.enable_eplb and target.routed_experts_weights_of_layer)
        if eplb_on and spec.rebalance_every > 0:
            calls = [0]

            def every_n(module, args, result):
                calls[0] += 1
                if calls[0] % spec.rebalance_every == 0:
                    out["eplb"].append(rebalance(module, recorder=recorder).summary())
            target.register_forward_hook(every_n)
        prompt = list(spec.prompt_ids)
        if draft is not None:
            from .speculative import speculative_generate   # engine/speculative.py

            tokens, stats = speculative_generate(target, draft, prompt, spec.max_new_tokens, spec.num_draft_tokens,
                                                 eos_token_id=eos or None)
            out.update(acceptance_rate=stats["acceptance_rate"], proposed=stats["proposed"],
                       accepted=stats["accepted"])
        else:
            tokens = generate(target, prompt, spec.max_new_tokens, eos_token_id=eos or None)[0].tolist()
        if eplb_on and spec.rebalance_every == 0:
            out["eplb"].append(rebalance(target, recorder=recorder).summary())
    out["tokens"] = [int(t) for t in tokens]
    return out


# -- the launcher --------------------------------------------------------------------

def generate_distributed(spec: WorkerSpec, nproc: int, *, timeout_s: float = 300) -> dict:
    """Run `spec` on `nproc` = pp_size x ep_size x tp_size ranks; the tokens, plan ids and EPLB figures.

    Raises engine.parallel.launch.RankFailed (the failing rank and its error) if any rank fails."""
    from .parallel.groups import check_sizes
    from .parallel.launch import launch

    check_sizes(nproc, spec.pp_size, spec.ep_size, spec.tp_size)
    if spec.registry is None:
        raise ValueError("WorkerSpec.registry: the ranks are processes of their own and ask one registry: give its "
                         "address (`loadplan serve`, or an embedded one: `loadplan generate` starts it)")
    spec = dataclasses.replace(spec, deployment=spec.deployment or uuid.uuid4().hex)
    ranks = launch(nproc, run_rank, spec, timeout_s=timeout_s)
    tokens = ranks[0]["tokens"]
    for r in ranks[1:]:
        if r["tokens"] != tokens:   # lockstep decoding makes this impossible unless a collective is wrong
            raise RuntimeError(f"ranks disagree on the tokens: rank 0 {tokens}, rank {r['rank']} {r['tokens']}")
    return {
        "tokens": tokens,
        "deployment": spec.deployment,
        "plan_ids": [r["plan_id"] for r in ranks],
        # Every rank's that holds the draft (with pipeline stages, a hidden-state draft is on the last only).
        "draft_plan_ids": [r["draft_plan_id"] for r in ranks if r["draft_plan_id"]] if spec.draft else [],
        "acceptance_rate": ranks[0]["acceptance_rate"],
        "proposed": ranks[0]["proposed"],
        "accepted": ranks[0]["accepted"],
        "eplb": {r["rank"]: r["eplb"] for r in ranks} if spec.runtime.enable_eplb else {},
        "ranks": ranks,
    }


__all__ = ["WorkerSpec", "run_rank", "generate_distributed", "init_rank", "load_runner"]
