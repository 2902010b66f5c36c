"""Run vLLM's `LLM(...)` with the loadplan plugin on: what the end-to-end tests run in the vLLM env.

    <vllm env>/bin/python run_vllm.py SPEC.json

SPEC: {"runs": [{"model": DIR, "dtype": "float32", "deployment": ID, "prompts": [[ids...]],
"max_tokens": N, "engine": {LLM kwargs}}]}. The runs share one process (one import of vLLM);
each run gets its own engine and workers (spawned), started with $LOADPLAN_DEPLOYMENT = its
deployment. One line per run on stdout, RESULT then JSON: {"tokens": [[...]], "plan_ids": [...], "start_s": S}
or {"error": TEXT}. The registry address comes from $LOADPLAN_REGISTRY as for any fleet.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

# vLLM logs to stdout too: a result line starts with this.
RESULT = "loadplan-run-vllm-result: "


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    from loadplan.integrations.vllm import plan_id_of

    os.environ["LOADPLAN_DEPLOYMENT"] = spec["deployment"]
    started = time.perf_counter()
    try:
        llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), skip_tokenizer_init=True,
                  max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0, **spec.get("engine", {}))
    except Exception as e:     # vLLM's error as a fleet sees it: the plugin's message is in it or above it
        return {"error": f"{type(e).__name__}: {e}"}
    start_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    # What an operator runs to find the plan a worker's model was built from.
    plan_ids = llm.apply_model(plan_id_of)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "plan_ids": plan_ids, "start_s": start_s}
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    for one in spec["runs"]:
        print(RESULT + json.dumps(run(one)), flush=True)


if __name__ == "__main__":     # vLLM spawns its engine and workers: they re-import this file
    main()
