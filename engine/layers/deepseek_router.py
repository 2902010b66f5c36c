"""DeepSeek-V3 gate: sigmoid scores, bias-corrected group-limited top-k, optional fused shared slot.

Selection uses `sigmoid(logits) + e_score_correction_bias`; the weights use the
un-biased scores (the bias only balances load). ERNIE-4.5's gate is the same with
softmax scores over the routed experts and one group (`scoring="softmax"`). Experts are split into `n_group`
groups, each scored by the sum of its two best biased scores; only the best
`topk_group` groups compete for the top-k.

The returned weights are final, as in transformers: renormalised when
`norm_topk_prob`, then multiplied by `routed_scaling_factor`, so the experts kernel
only has to sum weight * expert(x).

Fused shared expert (DESIGN 5.3): one extra column selects slot `n_routed_experts`
for every token. In the pre-scaling convention of the design its weight is
sum(routed)/rsf before renormalisation over the routed columns, i.e. 1/rsf after
it, so that the final multiplication by rsf makes the shared expert count exactly
x1. Without renormalisation the sum(routed)/rsf form would make it count
sum(routed) times instead, so the column is set to 1/rsf directly in both cases.
The column is then multiplied by `fused_shared_expert_scale` (the plan's
1/ep_size when each EP rank holds the slot and the outputs are all-reduced).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


SCORING = ("sigmoid", "softmax")


@dataclass(frozen=True)
class RouterSpec:
    """A DeepSeek-V3-style router: its experts and groups, and its departures (the module doc)."""

    hidden_size: int
    n_routed_experts: int
    top_k: int
    n_group: int | None = 1
    topk_group: int | None = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring: str = "sigmoid"            # SCORING
    # The renormalisation's divisor: the top-k sum clamped at `renorm_min` (ERNIE-4.5's moe_norm_min), else the sum
    # + 1e-20 (DeepSeek-V3's).
    renorm_min: float | None = None
    routing_bias: bool = True           # False: no load-balancing bias (Mistral 4's): top-k on the scores themselves
    logit_softcap: float = 0.0          # Laguna's: the logits soft-capped, cap * tanh(logits / cap) (0: not)


class DeepseekV3Router(nn.Module):
    def __init__(self, spec: RouterSpec, *, num_fused_shared_experts: int = 0, fused_shared_expert_scale: float = 1.0):
        """`num_fused_shared_experts`, `fused_shared_expert_scale`: the plan's fused slot, as the experts read it."""
        super().__init__()
        if spec.scoring not in SCORING:
            raise ValueError(f"scoring={spec.scoring!r} not supported; supported: {', '.join(SCORING)}")
        self.scoring = spec.scoring
        self.renorm_min = spec.renorm_min
        n_routed_experts = spec.n_routed_experts
        n_group = spec.n_group or 1
        topk_group = spec.topk_group or n_group
        if n_routed_experts % n_group:
            raise ValueError(f"n_routed_experts={n_routed_experts} is not divisible by n_group={n_group}")
        if num_fused_shared_experts not in (0, 1):
            # The gate fuses only n_shared_experts == 1 (DESIGN 5.2, structural condition).
            raise ValueError(f"num_fused_shared_experts={num_fused_shared_experts} not supported; supported: 0, 1")
        self.n_routed_experts = n_routed_experts
        self.top_k = spec.top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = spec.norm_topk_prob
        self.routed_scaling_factor = spec.routed_scaling_factor
        self.num_fused_shared_experts = num_fused_shared_experts
        self.fused_shared_expert_scale = fused_shared_expert_scale
        # float32 like the reference keeps them: near-tied sigmoid scores decide the experts.
        self.weight = nn.Parameter(torch.empty(n_routed_experts, spec.hidden_size, dtype=torch.float32))
        self.logit_softcap = spec.logit_softcap
        # None: a router without the load-balancing bias, its top-k chosen on the scores themselves
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(n_routed_experts, dtype=torch.float32), requires_grad=False
        ) if spec.routing_bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (topk_ids [T, K'], topk_weights [T, K'] float32), K' = top_k + num_fused_shared_experts."""
        T = x.shape[0]
        logits = F.linear(x.float(), self.weight.float())                  # [T, E]
        if self.logit_softcap > 0:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)
        biased = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_group > 1:
            per_group = biased.view(T, self.n_group, -1)
            group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
            keep = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            biased = per_group.masked_fill(~group_mask[..., None], float("-inf")).view(T, -1)
        ids = biased.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + 1e-20 if self.renorm_min is None else total.clamp(min=self.renorm_min))
        if self.num_fused_shared_experts:
            shared_ids = torch.full((T, 1), self.n_routed_experts, dtype=ids.dtype, device=ids.device)
            shared_w = torch.full((T, 1), 1.0 / self.routed_scaling_factor, dtype=weights.dtype, device=weights.device)
            ids = torch.cat([ids, shared_ids], dim=1)
            weights = torch.cat([weights, shared_w], dim=1)
        weights = weights * self.routed_scaling_factor
        if self.num_fused_shared_experts and self.fused_shared_expert_scale != 1.0:
            weights[:, -1] *= self.fused_shared_expert_scale
        return ids, weights

    def extra_repr(self) -> str:
        return (f"experts={self.n_routed_experts}, top_k={self.top_k}, groups={self.n_group}/{self.topk_group}, "
                f"rsf={self.routed_scaling_factor}, fused_shared={self.num_fused_shared_experts}, "
                f"scoring={self.scoring}")
