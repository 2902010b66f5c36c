"""EPLB rebalancing of a built model: counts -> placement -> moved weights -> recorded decision.

    report = rebalance(model, recorder=client)      # every EP rank of the stage calls it

1. The layers' token counters (RoutedExperts.load_counter, logical experts, recorded
   every forward) are summed over the stage's EP group (on the `a2a` path each rank
   routed only its own tokens; on `normal` every rank saw all of them and summing
   only scales the counts, which changes no placement).
2. `eplb.rebalance` computes a placement of the plan's `eplb.num_physical_experts`
   slots (the `ep_num_redundant_experts` extra ones replicate the hottest experts)
   that lowers max/mean tokens per rank; every rank computes the same one.
3. The expert weights move through the model's `routed_experts_weights_of_layer`
   (only this stage's MoE layers, keyed by global id): `apply_placement` in one
   process, `apply_placement_ep` across EP ranks. Replicas are exact copies, so the
   logits do not change.
4. The layers adopt the placement for routing; the counters restart.
5. With a `recorder` (a RegistryClient or anything with `append_decisions`), the
   placement is appended to this runner's plan as decision `eplb.placement`: one
   revision per rebalance, so the plan's history shows each.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from loadplan.plan import Decision, Keys
from .eplb import Placement, apply_placement, apply_placement_ep
from .eplb import rebalance as compute_placement
from .moe import RoutedExperts

RULE = "eplb.rebalance"


@dataclass
class RebalanceReport:
    layer_ids: tuple[int, ...]
    max_over_mean_before: dict[int, float]     # per layer: max rank load / mean rank load, old placement
    max_over_mean_after: dict[int, float]      # ... new placement (never worse)
    rows_moved: dict[int, int]                 # expert rows written on this rank
    placement: dict = field(default_factory=dict)   # Placement.to_json()
    revision: int | None = None                # of eplb.placement in the registry, when recorded

    def summary(self) -> dict[str, Any]:
        def mean(d):
            return sum(d.values()) / len(d) if d else 1.0
        return {"layers": list(self.layer_ids), "max_over_mean_before": mean(self.max_over_mean_before),
                "max_over_mean_after": mean(self.max_over_mean_after),
                "per_layer_before": {str(k): v for k, v in self.max_over_mean_before.items()},
                "per_layer_after": {str(k): v for k, v in self.max_over_mean_after.items()},
                "rows_moved": sum(self.rows_moved.values()), "revision": self.revision}


def eplb_layers(model: nn.Module) -> dict[int, RoutedExperts]:
    """{global layer id: experts} of the model's EPLB-enabled MoE layers (this stage's only)."""
    return {m.layer_id: m for m in model.modules() if isinstance(m, RoutedExperts) and m.placement is not None}


def current_placement(model: nn.Module) -> Placement:
    layers = eplb_layers(model)
    if not layers:
        raise RuntimeError("no EPLB-enabled MoE layer in this model (the plan's eplb.enabled is false, or this "
                           "pipeline stage has no MoE layer)")
    ids = tuple(sorted(layers))
    first = layers[ids[0]]
    p2l = torch.cat([layers[i].placement.phy2log for i in ids])
    return Placement(ids, p2l, first.ep_size, first.num_experts)


@torch.no_grad()
def rebalance(model: nn.Module, *, recorder: Any = None, group: Any = None) -> RebalanceReport:
    """Rebalance this rank's MoE layers (a collective over the EP group when ep_size > 1)."""
    layers = eplb_layers(model)
    old = current_placement(model)
    ids = old.layer_ids
    first = layers[ids[0]]
    group = group if group is not None else first.ep_group
    counts = torch.stack([layers[i].load_counter.counts[0] for i in ids])          # [L, n_logical]
    if first.ep_size > 1:
        import torch.distributed as dist

        dist.all_reduce(counts, group=group)
    new = compute_placement(counts, old.num_physical, old.ep_size, old=old, layer_ids=ids)
    weights = model.routed_experts_weights_of_layer
    if first.ep_size > 1:
        moved = apply_placement_ep(weights, old, new, group=group)
    else:
        moved = apply_placement(weights, old, new)
    for i in ids:
        layers[i].set_placement(new)
        layers[i].load_counter.reset()
    report = RebalanceReport(
        ids, {i: float(new.max_over_mean_before[r]) for r, i in enumerate(ids)},
        {i: float(new.max_over_mean_after[r]) for r, i in enumerate(ids)}, moved, new.to_json())
    if recorder is not None:
        report.revision = record_placement(recorder, model.plan.plan_id, report)
    return report


def record_placement(recorder: Any, plan_id: str, report: RebalanceReport) -> int:
    """Append the placement to the runner's plan; returns the new revision of `eplb.placement`."""
    s = report.summary()
    reason = (f"EPLB rebalance of layers {s['layers']}: max/mean tokens per rank "
              f"{s['max_over_mean_before']:.3f} -> {s['max_over_mean_after']:.3f}")
    plan = recorder.append_decisions(uuid.uuid4().hex, plan_id,
                                     [Decision(Keys.EPLB_PLACEMENT, report.placement, reason, RULE,
                                               deployment_wide=False)])
    return plan.decisions[Keys.EPLB_PLACEMENT].revision


__all__ = ["rebalance", "RebalanceReport", "eplb_layers", "current_placement", "record_placement"]
