"""Run vLLM's `LLM(...)` with the loadplan plugin on: what the end-to-end tests run in the vLLM env.

    <vllm env>/bin/python run_vllm.py SPEC.json

SPEC: {"runs": [{"model": DIR, "dtype": "float32", "deployment": ID, "prompts": [[ids...]],
"max_tokens": N, "engine": {LLM kwargs}, "env": {NAME: VALUE}}]}. The runs share one process (one
import of vLLM); each run gets its own engine and workers (spawned), started with
$LOADPLAN_DEPLOYMENT = its deployment (a run without one: unset, the plugin's default id) and its
"env" set (then restored for the next run). One line per run on stdout, RESULT then JSON:
{"tokens": [[...]], "plan_ids": [...], "start_s": S, "spec_decode": {counter: value}} or {"error": TEXT};
spec_decode holds vLLM's speculative-decoding counters, where the run logs stats
("engine": {"disable_log_stats": false}) and drafts. The registry address comes from
$LOADPLAN_REGISTRY as for any fleet.
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

    if spec.get("deployment"):
        os.environ["LOADPLAN_DEPLOYMENT"] = spec["deployment"]
    else:
        os.environ.pop("LOADPLAN_DEPLOYMENT", None)
    saved = {name: os.environ.get(name) for name in spec.get("env", {})}
    os.environ.update(spec.get("env", {}))    # read by the processes this run spawns
    try:
        return start_and_generate(spec, LLM, SamplingParams, plan_id_of)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_and_generate(spec: dict, LLM, SamplingParams, plan_id_of) -> dict:
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
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "plan_ids": plan_ids, "start_s": start_s,
              "spec_decode": spec_decode_counters(llm)}
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def spec_decode_counters(llm) -> dict:
    """vLLM's speculative-decoding counters of this process (empty unless the run logs stats)."""
    from vllm.v1.metrics.reader import Counter

    try:
        metrics = llm.get_metrics()
    except Exception:       # stats not logged: no metrics
        return {}
    return {m.name: m.value for m in metrics if isinstance(m, Counter) and m.name.startswith("vllm:spec_decode")}


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    for one in spec["runs"]:
        print(RESULT + json.dumps(run(one)), flush=True)


if __name__ == "__main__":     # vLLM spawns its engine and workers: they re-import this file
    main()
