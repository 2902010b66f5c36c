"""Multi-process execution: the rank launcher, the (pp, ep) process groups, the MoE
token exchange of both forward paths, and pipeline point-to-point transfers.

Nothing here reads a backend name: callers pick the forward path from the plan.
"""

from .launch import RankFailed, launch, rank_device, set_seed

__all__ = ["RankFailed", "launch", "rank_device", "set_seed"]
