"""The routed-experts layer: stacked expert weights, global -> local slots, the planned reduction.

The arithmetic (tokens sorted by expert, one matmul pair per hit expert) is
engine/expert_kernel.py's `fused_experts`.

Shapes: T tokens, K slots per token (top-k, plus fused shared slots), D hidden,
I expert intermediate, E local routed experts, S fused shared slots.

    gate_up_proj [E + S, 2I, D]   rows [0, I) gate, [I, 2I) up  (HF's layout)
    down_proj    [E + S, D, I]

Expert ids in `topk_ids` are GLOBAL: routed experts are [0, n_routed), the fused
shared slots are n_routed, n_routed + 1, ... (DESIGN 5.3). This rank holds the
routed experts [local_start, local_start + E) and every fused slot; tokens routed
to other ranks' experts contribute nothing here (their owners compute them).

What the layer keeps from the plan, at construction (never read during forward):
- `num_fused_shared_experts`, `fused_shared_expert_scale` (moe.*): how many shared
  slots follow the routed ones and the multiplier of their routing weight;
- `num_local_experts` (moe.num_local_routed_experts) -> the local expert range;
- `post_experts_all_reduce`: whether `reduce` runs on the layer's output (DESIGN
  5.4); `forward_path` ("normal" / "a2a").
Expert-parallel execution across processes is a later issue: `reduce` defaults to
torch.distributed's all-reduce and is an attribute so a test or an executor can
replace it; the a2a dispatch/combine with ep_size > 1 is refused at build time.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..plan import Keys
from .expert_kernel import fused_experts


def _dist_all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the plan says moe.post_experts_all_reduce but torch.distributed is not initialized "
                           "(set RoutedExperts.reduce for a single-process run)")
    dist.all_reduce(x)
    return x


class RoutedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, plan, *,
                 layer_id: int, dtype: torch.dtype | None = None):
        super().__init__()
        par = plan.request.parallel
        self.layer_id = layer_id
        self.num_experts = num_experts                      # global routed experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_fused_shared_experts = int(plan.decisions[Keys.NUM_FUSED_SHARED_EXPERTS].value)
        self.fused_shared_expert_scale = float(plan.decisions[Keys.FUSED_SHARED_EXPERT_SCALE].value)
        self.post_experts_all_reduce = bool(plan.decisions[Keys.POST_EXPERTS_ALL_REDUCE].value)
        self.forward_path = str(plan.decisions[Keys.FORWARD_PATH].value)
        self.num_local_experts = int(plan.decisions[Keys.NUM_LOCAL_EXPERTS].value)
        if self.num_local_experts * par.ep_size != num_experts:
            # EPLB's redundant (physical != logical) experts need a placement map: the EPLB issue.
            raise NotImplementedError(
                f"layer {layer_id}: {self.num_local_experts} local x ep_size={par.ep_size} physical experts != "
                f"{num_experts} routed experts; redundant EPLB experts are not supported yet")
        if self.forward_path != "normal" and par.ep_size > 1:
            raise NotImplementedError(f"layer {layer_id}: moe.forward_path={self.forward_path!r} with ep_size="
                                      f"{par.ep_size} needs a dispatch/combine executor, not implemented yet")
        self.local_start = par.ep_rank * self.num_local_experts
        self.num_slots = self.num_local_experts + self.num_fused_shared_experts
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_slots, 2 * intermediate_size, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.num_slots, hidden_size, intermediate_size, dtype=dtype),
                                      requires_grad=False)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _dist_all_reduce

    # -- routing helpers -----------------------------------------------------
    def append_shared_slots(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                            shared_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token also selects each fused shared slot (DESIGN 5.3).

        shared_weights [T, S]: the slot's routing weight per token before the plan's
        scale (1 for DeepSeek-style, sigmoid(shared_expert_gate(x)) for Qwen2-MoE)."""
        T, S = topk_ids.shape[0], self.num_fused_shared_experts
        assert S > 0, "append_shared_slots on a layer without fused shared experts"
        ids = torch.arange(self.num_experts, self.num_experts + S, device=topk_ids.device, dtype=topk_ids.dtype)
        ids = ids.expand(T, S)
        w = shared_weights.to(topk_weights.dtype) * self.fused_shared_expert_scale
        return torch.cat([topk_ids, ids], dim=1), torch.cat([topk_weights, w], dim=1)

    def _local_slots(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global ids -> local slot ids; ids of other ranks' experts -> num_slots (dropped)."""
        routed = topk_ids < self.num_experts
        local = topk_ids - self.local_start
        in_range = routed & (local >= 0) & (local < self.num_local_experts)
        shared = topk_ids - self.num_experts + self.num_local_experts   # fused slots follow the local experts
        return torch.where(in_range, local, torch.where(routed, torch.full_like(local, self.num_slots), shared))

    # -- the kernel ----------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], topk_ids [T, K] (global ids), topk_weights [T, K] -> [T, D].

        Rows are sorted by local slot and each hit expert runs one matmul pair over its
        contiguous slice (engine/expert_kernel.py); other ranks' experts are dropped."""
        slots = self._local_slots(topk_ids)                                  # [T, K]
        y = fused_experts(x, slots, topk_weights, self.gate_up_proj, self.down_proj)   # [T, D]
        if self.post_experts_all_reduce:
            y = self.reduce(y)   # every rank calls it, even with no local rows: it is a collective
        return y

    # -- EPLB ----------------------------------------------------------------
    def get_moe_weights(self) -> list[torch.Tensor]:
        """The movable expert tensors, dim 0 = local physical expert (fused shared slots excluded)."""
        E = self.num_local_experts
        return [self.gate_up_proj[:E], self.down_proj[:E]]

    def extra_repr(self) -> str:
        return (f"layer={self.layer_id}, experts={self.num_experts} (local [{self.local_start}, "
                f"{self.local_start + self.num_local_experts})), fused_shared={self.num_fused_shared_experts}"
                f" x{self.fused_shared_expert_scale:g}, hidden={self.hidden_size}, inter={self.intermediate_size}, "
                f"path={self.forward_path}, all_reduce={self.post_experts_all_reduce}")
