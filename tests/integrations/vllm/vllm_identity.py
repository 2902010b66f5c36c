"""The plugin's `identity_of` on vLLM's own config objects, in worker groups laid out as asked: run in the vLLM env.

    <vllm env>/bin/python vllm_identity.py CHECKPOINTS_DIR  ->  one JSON document on the last stdout line

For each layout (pipeline stages, data parallel ranks), the worker's process groups are set where
vLLM keeps them (`vllm.distributed.parallel_state._TP`, `_PP`, `_DP`, `_PCP`: every accessor vLLM's
layers call reads these) to the last rank of each group; then the identity of the target (built
under the target's ParallelConfig) and of a draft model (built under the ParallelConfig vLLM makes
for a draft, `SpeculativeConfig.create_draft_parallel_config`, as `DraftModelProposer` builds it) is
read by `identity_of`, for an MoE draft and a dense one (vLLM gives only an MoE draft expert
parallelism). CHECKPOINTS_DIR holds `target/config.json` and `draft/config.json`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

LAYOUTS = [dict(pipeline_parallel_size=2), dict(data_parallel_size=2),
           dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)]


class Group:
    """What vLLM's accessors read of a GroupCoordinator."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.rank_in_group = world_size - 1
        self.is_first_rank = self.rank_in_group == 0
        self.is_last_rank = True


def main() -> None:
    from vllm.config import ParallelConfig
    from vllm.config.speculative import SpeculativeConfig
    from vllm.distributed import parallel_state

    from loadplan.integrations.vllm.identity import default_deployment, identity_of

    root = Path(sys.argv[1])

    def model_config(name: str, is_moe: bool = True):
        config = json.loads((root / name / "config.json").read_text())
        return SimpleNamespace(model=str(root / name), revision=None, architectures=config["architectures"],
                               quantization=None, is_moe=is_moe)

    target = model_config("target")
    out = []
    for layout, draft_is_moe in ((layout, moe) for layout in LAYOUTS for moe in (True, False)):
        draft = model_config("draft", draft_is_moe)
        target_pc = ParallelConfig(**layout)
        draft_pc = SpeculativeConfig.create_draft_parallel_config(target_pc, target_pc.tensor_parallel_size,
                                                                  draft_model_config=draft)
        parallel_state._TP = Group(target_pc.tensor_parallel_size)
        parallel_state._PP = Group(target_pc.pipeline_parallel_size)
        parallel_state._DP = Group(target_pc.data_parallel_size)
        parallel_state._PCP = Group(1)
        speculative = SimpleNamespace(draft_model_config=draft, target_model_config=target,
                                      target_parallel_config=target_pc)
        row = {"layout": layout, "draft_is_moe": draft_is_moe,
               "draft_parallel_config": {"pipeline_parallel_size": draft_pc.pipeline_parallel_size,
                                         "data_parallel_size": draft_pc.data_parallel_size}}
        for role, pc, mc in (("target", target_pc, target), ("draft", draft_pc, draft)):
            identity = identity_of(SimpleNamespace(parallel_config=pc, speculative_config=speculative), mc)
            row[role] = {"role": identity.role, "model": identity.model,
                         "parallel": dataclasses.asdict(identity.parallel),
                         "deployment": default_deployment(identity)}
        out.append(row)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
