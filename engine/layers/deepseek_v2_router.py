"""DeepSeek-V2 gate: softmax scores, top-k greedy or group-limited, weights times routed_scaling_factor.

As transformers' DeepseekV2TopkRouter (float32 throughout):
- `greedy`: the top-k of the softmax over all experts;
- `group_limited_greedy`: experts split into `n_group` groups, each scored by its best
  expert; only the best `topk_group` groups compete, the others' scores set to 0 (not
  -inf: with fewer than top_k experts left, zeros are picked, with weight 0);
- no renormalisation, no score bias; the weights are multiplied by routed_scaling_factor.

There is no fused shared-expert column: the registry never fuses DeepSeek-V2's shared
experts (DESIGN 5.2, structural condition 4: not the fused architecture).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekV2Router(nn.Module):
    def __init__(self, hidden_size: int, n_routed_experts: int, top_k: int, topk_method: str, n_group: int = 1,
                 topk_group: int = 1, routed_scaling_factor: float = 1.0):
        super().__init__()
        if topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {topk_method!r} not supported; supported: {', '.join(TOPK_METHODS)}")
        if topk_method == "group_limited_greedy" and n_routed_experts % n_group:
            raise ValueError(f"n_routed_experts={n_routed_experts} is not divisible by n_group={n_group}")
        self.n_routed_experts = n_routed_experts
        self.top_k = top_k
        self.topk_method = topk_method
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(n_routed_experts, hidden_size, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (topk_ids [T, K], topk_weights [T, K] float32)."""
        T = x.shape[0]
        scores = F.linear(x.float(), self.weight.float()).softmax(dim=-1, dtype=torch.float32)   # [T, E]
        if self.topk_method == "group_limited_greedy":
            per_group = scores.view(T, self.n_group, -1)                                      # [T, G, E/G]
            keep = per_group.max(dim=-1).values.topk(self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros(T, self.n_group, dtype=torch.bool, device=x.device).scatter_(1, keep, True)
            scores = per_group.masked_fill(~group_mask[..., None], 0.0).view(T, -1)
        weights, ids = scores.topk(self.top_k, dim=-1, sorted=False)
        return ids, weights * self.routed_scaling_factor

    def extra_repr(self) -> str:
        return (f"experts={self.n_routed_experts}, top_k={self.top_k}, {self.topk_method}, "
                f"groups={self.n_group}/{self.topk_group}, rsf={self.routed_scaling_factor}")
