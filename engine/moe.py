"""The routed-experts layer: stacked expert weights, global -> local slots, the planned reduction.

The arithmetic (tokens sorted by expert, one matmul pair per hit expert) is
engine/expert_kernel.py's `fused_experts`; the token exchange of the `a2a` path is
engine/parallel/a2a.py.

Shapes: T tokens, K slots per token (top-k, plus fused shared slots), D hidden,
I expert intermediate, E local physical experts, S fused shared slots, P physical
experts in all (= routed experts without EPLB redundancy).

    gate_up_proj [E + S, 2I, D]   rows [0, I) gate, [I, 2I) up  (HF's layout)
    down_proj    [E + S, D, I]
    gate_up_bias [E + S, 2I], down_bias [E + S, D]   (gpt-oss only: `bias=True`, with its own
                                                  `activation`; expert_kernel.general_experts)
With `gated=False` (Nemotron-H's relu^2 experts: up_proj and down_proj, no gate) the first projection holds the up
rows alone, gate_up_proj [E + S, I, D], and the layer's `activation` maps [N, I] to [N, I].

Expert ids in `topk_ids` are GLOBAL LOGICAL ids: routed experts are [0, n_routed),
the fused shared slots n_routed, n_routed + 1, ... (DESIGN 5.3). With EPLB they are
first mapped to physical slots (`eplb.to_physical`: one replica per token; the
fused slots become P, P + 1, ...). This rank holds physical slots
[local_start, local_start + E) and every fused slot.

What the layer keeps from the plan, at construction (never read during forward):
- `num_fused_shared_experts`, `fused_shared_expert_scale` (moe.*): how many shared
  slots follow the routed ones and the multiplier of their routing weight;
- `num_local_experts` (moe.num_local_routed_experts), `num_physical`
  (eplb.num_physical_experts) -> the local slot range; with EPLB enabled a
  `placement` (slot p holds expert p % n_routed until a rebalance) and a
  `load_counter` (tokens per logical expert, recorded every forward);
- `forward_path` and `post_experts_all_reduce` (DESIGN 5.4):
    normal: every rank holds all tokens and computes its local experts' partial sums
            (a fused global slot scaled by the plan's 1/ep_size), then `reduce` runs
            iff the plan says so: ONE all-reduce over the EP group;
    a2a:    with ep_size > 1 each rank dispatches its tokens to the ranks owning their
            experts, the owners compute, combine returns complete rows; `reduce`
            runs only if the plan says so, which it never does for a backend whose
            combine already sums (the double-reduction bug, DESIGN 1).
Tensor parallelism (plan parallel.tp_size > 1): on the normal path every expert's
intermediate features are split over the TP ranks (gate/up rows, down columns), so each
rank holds a partial sum of every token's output and the planned all-reduce runs over
the TP group; with ep_size > 1 too, over the whole stage (its experts split both ways;
the fused slot's 1/ep_size scale still counts it once). On the a2a path experts are
never split by features (the combine's rows are complete and the plan reduces nothing
after it): each TP rank holds its EP share whole and dispatches over the EP group of
its own TP rank; its TP peers hold the same tokens and compute the same rows.
The EP (or TP) group comes from the process's parallel context (engine/parallel/context.py)
at construction. `reduce` is an attribute so a single-process test can replace it.
An unfused shared expert is not this layer's: the model adds it after `forward`
returns (after the reduction), computed replicated, never summed once per rank.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from loadplan.plan import Keys
from .eplb import ExpertLoadCounter, Placement, to_physical
from .expert_kernel import fused_experts, general_experts, silu_mul
from .parallel import context as parallel_context
from .parallel.tensor import TensorParallel


def _dist_all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the plan says moe.post_experts_all_reduce but torch.distributed is not initialized "
                           "(set RoutedExperts.reduce for a single-process run)")
    dist.all_reduce(x)
    return x


class RoutedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, plan, *,
                 layer_id: int, dtype: torch.dtype | None = None, bias: bool = False, activation=None,
                 weight_inputs: bool = False, gated: bool = True):
        super().__init__()
        if not gated and activation is None:
            raise ValueError(f"layer {layer_id}: experts without a gate need their activation (silu_mul gates)")
        self.gated = gated
        par = plan.request.parallel
        self.layer_id = layer_id
        self.num_experts = num_experts                      # global routed (logical) experts
        self.hidden_size = hidden_size
        self.ep_size, self.ep_rank = par.ep_size, par.ep_rank
        self.num_fused_shared_experts = int(plan.decisions[Keys.NUM_FUSED_SHARED_EXPERTS].value)
        self.fused_shared_expert_scale = float(plan.decisions[Keys.FUSED_SHARED_EXPERT_SCALE].value)
        self.post_experts_all_reduce = bool(plan.decisions[Keys.POST_EXPERTS_ALL_REDUCE].value)
        self.forward_path = str(plan.decisions[Keys.FORWARD_PATH].value)
        # The a2a path's combine returns complete rows and the plan reduces nothing after it, so its
        # experts are not split by features: on TP ranks each holds its EP share of the experts whole
        # (MoE TP size 1, as SGLang and vLLM run an all-to-all backend) and exchanges tokens with the
        # EP ranks of its own TP rank. The normal path splits them (one all-reduce completes them).
        self.tp = TensorParallel.of(plan) if self.forward_path != "a2a" else TensorParallel()
        if self.tp.size > 1 and not self.post_experts_all_reduce:
            raise ValueError(
                f"layer {layer_id}: the plan says moe.post_experts_all_reduce false "
                f"({plan.decisions[Keys.POST_EXPERTS_ALL_REDUCE].reason}) on the {self.forward_path} path, but "
                f"tp_size={par.tp_size} splits every expert's intermediate features there: each rank would "
                f"keep a partial sum")
        intermediate_size = self.tp.split(intermediate_size, "moe_intermediate_size")
        self.intermediate_size = intermediate_size
        self.num_local_experts = int(plan.decisions[Keys.NUM_LOCAL_EXPERTS].value)
        self.eplb_enabled = bool(plan.decisions[Keys.EPLB_ENABLED].value)
        self.num_physical = int(plan.decisions[Keys.EPLB_NUM_PHYSICAL_EXPERTS].value)
        if self.num_local_experts * par.ep_size != self.num_physical or self.num_physical < num_experts:
            raise ValueError(f"layer {layer_id}: {self.num_local_experts} local x ep_size={par.ep_size} slots != "
                             f"{self.num_physical} physical experts (>= {num_experts} routed) of the plan")
        if self.num_physical != num_experts and not self.eplb_enabled:
            raise ValueError(f"layer {layer_id}: {self.num_physical} physical slots for {num_experts} experts "
                             f"without EPLB: nothing would map experts to their replicas")
        self.local_start = par.ep_rank * self.num_local_experts
        self.num_slots = self.num_local_experts + self.num_fused_shared_experts
        rows = (2 if gated else 1) * intermediate_size      # gate and up rows, or up alone
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_slots, rows, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.num_slots, hidden_size, intermediate_size, dtype=dtype),
                                      requires_grad=False)
        # gpt-oss: every expert's projections carry biases and its activation is its own (expert_kernel's
        # `general_experts`). Split by features over TP ranks, the gate/up bias splits like its rows; the
        # down projection's bias is whole and added by the first TP rank only (the others' partial sums
        # are summed onto it).
        self.gate_up_bias = self.down_bias = None
        if bias:
            self.gate_up_bias = nn.Parameter(torch.empty(self.num_slots, rows, dtype=dtype), requires_grad=False)
            self.down_bias = nn.Parameter(torch.empty(self.num_slots, hidden_size, dtype=dtype),
                                          requires_grad=False)
        self.activation = activation
        self.adds_down_bias = self.tp.size == 1 or par.tp_rank == 0
        # Llama 4: the routing weight scales each expert's input, not its output (expert_kernel.general_experts).
        self.weight_inputs = weight_inputs
        # Which implementation computes the experts (engine/expert_choice.py's IMPLS): None, the one measured
        # fastest on this machine for the call's shape class (or LOADPLAN_EXPERTS_IMPL's); a name forces it.
        self.experts_impl: str | None = None

        # The EP group of this rank: from the worker's parallel context, fixed at build time.
        ctx = parallel_context.current()
        self.ep_group = None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = self.tp.reduce if self.tp.size > 1 else _dist_all_reduce
        if par.ep_size > 1 and ctx is not None:
            g = ctx.grid
            if (g.ep_size, g.ep_rank) != (par.ep_size, par.ep_rank):
                raise ValueError(f"layer {layer_id}: plan is for ep rank {par.ep_rank}/{par.ep_size} but this "
                                 f"process is ep rank {g.ep_rank}/{g.ep_size}")
            from .parallel.a2a import all_reduce_sum

            self.ep_group = ctx.ep_group     # this TP rank's EP ranks
            # The ranks holding partial sums: the EP group; with experts split by TP rank too, the stage.
            group = g.experts_group if self.tp.size > 1 else ctx.ep_group
            self.reduce = functools.partial(all_reduce_sum, group=group)
        # a2a over several ranks moves tokens between processes: it needs the group now, not at the first forward.
        self.dispatch_tokens = self.forward_path == "a2a" and par.ep_size > 1
        if self.dispatch_tokens and ctx is None:
            raise RuntimeError(f"layer {layer_id}: moe.forward_path='a2a' with ep_size={par.ep_size} needs an EP "
                               f"process group: set engine.parallel.context before building (engine/worker.py does)")

        # EPLB: plain tensors made on the CPU (the model is built on meta), moved on first use.
        self.placement: Placement | None = None
        self.load_counter: ExpertLoadCounter | None = None
        if self.eplb_enabled:
            with torch.device("cpu"):
                self.placement = Placement.initial((layer_id,), num_experts, self.num_physical, par.ep_size)
                self.load_counter = ExpertLoadCounter((layer_id,), num_experts, device="cpu")

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

    def _local_slots(self, phys_ids: torch.Tensor) -> torch.Tensor:
        """Physical ids -> local slot ids; ids of other ranks' slots -> num_slots (dropped)."""
        routed = phys_ids < self.num_physical
        local = phys_ids - self.local_start
        in_range = routed & (local >= 0) & (local < self.num_local_experts)
        shared = phys_ids - self.num_physical + self.num_local_experts   # fused slots follow the local experts
        return torch.where(in_range, local, torch.where(routed, torch.full_like(local, self.num_slots), shared))

    def set_placement(self, placement: Placement) -> None:
        """Adopt this layer's row of `placement` (after its weights were moved to it)."""
        if self.placement is None:
            raise RuntimeError(f"layer {self.layer_id}: EPLB is not enabled by the plan")
        if (placement.num_physical, placement.num_logical, placement.ep_size) != \
                (self.num_physical, self.num_experts, self.ep_size):
            raise ValueError(f"layer {self.layer_id}: placement of {placement.num_physical} slots / "
                             f"{placement.num_logical} experts / ep_size={placement.ep_size} does not fit "
                             f"{self.num_physical} / {self.num_experts} / {self.ep_size}")
        row = placement.row(self.layer_id)
        self.placement = Placement((self.layer_id,), placement.phy2log[row:row + 1].clone(), self.ep_size,
                                   self.num_experts)

    # -- the kernel ----------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], topk_ids [T, K] (global logical ids), topk_weights [T, K] -> [T, D]."""
        if self.load_counter is not None:
            if self.load_counter.counts.device != topk_ids.device:
                self.load_counter.counts = self.load_counter.counts.to(topk_ids.device)
            self.load_counter.record(self.layer_id, topk_ids)       # fused slots are not counted
        if self.placement is not None:
            topk_ids = to_physical(topk_ids, self.placement, self.layer_id)
        if self.dispatch_tokens:
            y = self._dispatch_compute_combine(x, topk_ids, topk_weights)
        else:
            # One rank holding every physical slot: physical ids already are slot ids (fused slots follow).
            if self.num_local_experts == self.num_physical:
                slots = topk_ids.masked_fill(topk_ids < 0, self.num_slots)   # masked picks (id -1): dropped
            else:
                slots = self._local_slots(topk_ids)
            y = self._experts(x, slots, topk_weights)
        if self.post_experts_all_reduce:
            y = self.reduce(y)   # every rank calls it, even with no local rows: it is a collective
        return y

    def _dispatch_compute_combine(self, x: torch.Tensor, phys_ids: torch.Tensor,
                                  weights: torch.Tensor) -> torch.Tensor:
        from .parallel.a2a import combine, dispatch

        rx, rslots, rw, handle = dispatch(x, phys_ids, weights, self.num_local_experts, self.ep_group,
                                          num_routed=self.num_physical)
        if rx.shape[0]:
            rows = self._experts(rx, rslots[:, None], rw[:, None])
        else:
            rows = rx.new_zeros((0, self.hidden_size))
        return combine(rows, handle, weighted=True)                  # complete: no reduction may follow

    def _experts(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The local experts' weighted rows summed per token: x [T, D], slots [T, K] local ids -> [T, D]."""
        if self.gate_up_bias is None and self.activation is None and not self.weight_inputs:
            return fused_experts(x, slots, weights, self.gate_up_proj, self.down_proj, impl=self.experts_impl)
        return general_experts(x, slots, weights, self.gate_up_proj, self.down_proj, gate_up_bias=self.gate_up_bias,
                               down_bias=self.down_bias if self.adds_down_bias else None,
                               act=self.activation or silu_mul, weight_inputs=self.weight_inputs)

    def weight_layout_fields(self) -> dict:
        """What engine.weights.WeightLayout takes from this layer (alike on every MoE layer of a runner): its
        fused shared slots, its physical slots and the local range of them, whether TP splits the experts."""
        return dict(num_fused_shared=self.num_fused_shared_experts,
                    local_experts=(self.local_start, self.local_start + self.num_local_experts),
                    num_physical=self.num_physical, tp_split_experts=self.tp.size > 1, gated_experts=self.gated)

    # -- EPLB ----------------------------------------------------------------
    def get_moe_weights(self) -> list[torch.Tensor]:
        """The movable expert tensors, dim 0 = local physical expert (fused shared slots excluded)."""
        E = self.num_local_experts
        biases = [] if self.gate_up_bias is None else [self.gate_up_bias[:E], self.down_bias[:E]]
        return [self.gate_up_proj[:E], self.down_proj[:E], *biases]

    def extra_repr(self) -> str:
        return (f"layer={self.layer_id}, experts={self.num_experts} (physical {self.num_physical}, local "
                f"[{self.local_start}, {self.local_start + self.num_local_experts})), fused_shared="
                f"{self.num_fused_shared_experts} x{self.fused_shared_expert_scale:g}, hidden={self.hidden_size}, "
                f"inter={self.intermediate_size}, path={self.forward_path}, all_reduce={self.post_experts_all_reduce}"
                f"{', eplb' if self.eplb_enabled else ''}")
