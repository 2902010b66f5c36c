"""Record SGLang 0.5.23's own load-time decisions over the conformance grid.

Runs tests/conformance/sglang_oracle.py (SGLang's own code, one process per emulated
device, under the SGLang environment made by `make sglang-env`) over every grid point and
writes the answers as data: a gzipped JSON-lines file whose first line says the SGLang
version, this script and its inputs, and each further line is one point and SGLang's
answer. The conformance test (tests/conformance/test_sglang_conformance.py) checks the
registry against every recorded point and re-runs SGLang live on a sample of them.

    .venv-sglang/bin/python scripts/record_sglang_grid.py            # the whole grid
    .venv-sglang/bin/python scripts/record_sglang_grid.py --limit 50 # a quick look

Grid (and how it is pruned):
- main: every config × every a2a backend SGLang 0.5.23 accepts × 4 devices × 3 tp/ep/dp
  shapes × intent/overlap flags. Families with shared experts get 6 flag combinations
  (none, disable, enforce, SBO, TBO, enforce+TBO); families without shared experts get
  3 (none, SBO, TBO), since the fusion intent flags reach no gate there.
- runner: the families with shared experts × MoE runner backends that SGLang's
  resolution treats specially × 4 devices, tp 8, backend none.
- pipeline: every config × pp 2, 3, 4 (layer ranges per stage), cuda:9.0, tp 8.
- eplb: every config × EPLB on, backends none and deepep, ep 8, cuda:9.0.
- draft: target + draft pairs (a NextN draft and a Qwen3 draft), per device, inside
  SGLang's draft build scope, with and without EPLB on ep 8, and on one tp group of 8.
- entries: minimal configs of rules-only entry classes SGLang gates (tests/conformance/configs:
  Dots3, DeepSeek-V4, DeepSeek-OCR, MiniCPM-V 4.6, MiniMax-M3, and Pixtral over a deepseek_v3 text_config, once
  naming DeepseekV3ForCausalLM and once MistralLarge3ForCausalLM as SGLang's Mistral-format parser writes it),
  and gated families with n_shared_experts 0 (DeepSeek-V3, GLM-4.5, Dots3, MiniMax-M3: their gates may pass, the
  count is 0) × backends none and deepep × tp/ep 8/1 and 2/4 × enforce or not, cuda:9.0.
- blocks: minimal configs of the families SGLang builds beyond the real ones (those whose MoE block has its own
  dispatch branch first: MiniMax-M2, EXAONE-MoE, MiMo-V2-Flash, Step-3.5, GLM-4.7-Flash, MiniMax-M3, Dots3,
  Nemotron-H; then the rest the engine tests build) × every a2a backend × 4 devices × the 3 shapes.
- engine_env: SGLang's environment switches the profile reads (SGLANG_USE_AITER as 1, true and 0): the Qwen2-MoE
  block's classes, Qwen1.5-MoE and DeepSeek-V3 × backends none, mooncake and deepep × cuda:9.0, hip:9.4 and hip:9.5
  × tp/ep 8/1 and 2/4; each point answered by an oracle process started with that environment.
- qwen_block: the classes whose Qwen2-MoE block decides its own fusion while it is built (Qwen3-Next, once with
  n_shared_experts 0; Qwen3.5-MoE; MiniCPM-V 4.6) × the backends its fusion or its forward reads × 4 devices ×
  tp/ep 8/1 and 2/4 × none, disable or enforce.

`--only GRID` records one sub-grid and replaces that sub-grid's points in the existing
recording (the other points and their answers are kept as recorded, with their date).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "conformance"))
from sglang_agreement import oracle_args  # noqa: E402  (the tests' own grouping, one definition)
ORACLE = ROOT / "tests" / "conformance" / "sglang_oracle.py"
NEWEST = "0.5.23"


def environment(release: str) -> Path:
    """The SGLang environment of a release (the Makefile's sglang-env: the newest in .venv-sglang)."""
    return ROOT / (".venv-sglang" if release == NEWEST else f".venv-sglang-{release}")


def recording(release: str) -> Path:
    return ROOT / "tests" / "data" / f"sglang_{release}_grid.jsonl.gz"

CONFIGS_SHARED = ["deepseek-v3", "kimi-k2", "kimi-k2.5", "glm-4.5", "qwen1.5-moe-a2.7b"]
CONFIGS_UNSHARED = ["qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b"]
A2A_BACKENDS = ["none", "deepep", "mooncake", "nixl", "mori", "ascend_fuseep", "flashinfer",
                "megamoe", "deepep_v2", "ascend_tp", "pplx", "flashinfer_megamoe"]
DEVICES = ["cuda:8.0", "cuda:9.0", "cuda:10.0", "hip:9.4"]
# The environment switches the sglang profile reads (service/rules/engine_inputs.py), as a server may set them.
ENGINE_ENVS = [{"SGLANG_USE_AITER": "1"}, {"SGLANG_USE_AITER": "true"}, {"SGLANG_USE_AITER": "0"}]
DEVICES_ENGINE_ENV = ["cuda:9.0", "hip:9.4", "hip:9.5"]
# loadplan's (tp, ep, dp); SGLang gets tp = tp*ep, ep = ep, and attention DP = dp.
SHAPES = [(8, 1, 1), (2, 4, 1), (1, 8, 8)]
FLAGS_SHARED = [{}, {"disable_fusion": True}, {"enforce_fusion": True}, {"sbo": True},
                {"tbo": True}, {"enforce_fusion": True, "tbo": True}]
FLAGS_UNSHARED = [{}, {"sbo": True}, {"tbo": True}]
RUNNERS = ["triton", "deep_gemm", "flashinfer_trtllm", "flashinfer_cutedsl", "flashinfer_cutlass",
           "flashinfer_trtllm_routed", "experimental_sgl_trtllm", "marlin", "aiter"]
PP_SIZES = [2, 3, 4]
# (target, draft): a draft naming the target's own config is its NextN layer.
DRAFTS = [("deepseek-v3", "deepseek-v3"), ("kimi-k2", "kimi-k2"), ("glm-4.5", "glm-4.5"),
          ("qwen3-30b-a3b", "qwen3-0.6b")]
# Minimal configs (tests/conformance/configs) of rules-only entry classes SGLang 0.5.23 gates.
CONFIGS_ENTRIES = ["tiny-dots3", "tiny-deepseek-v4", "tiny-deepseek-ocr", "tiny-minicpmv4_6", "tiny-minimax-m3",
                   "tiny-pixtral", "tiny-pixtral-ml3", "tiny-deepseek-v3-unshared", "tiny-glm-4.5-unshared",
                   "tiny-dots3-unshared", "tiny-minimax-m3-unshared"]
# Minimal configs of every family both loadplan's engine and SGLang build, beside the real ones: those whose MoE
# block dispatches itself for some backends first.
CONFIGS_BLOCKS = ["tiny-minimax-m2", "tiny-exaone-moe", "tiny-mimo-v2-flash", "tiny-step3p5", "tiny-glm-4.7-flash",
                  "tiny-minimax-m3", "tiny-dots3", "tiny-nemotron-h",
                  # the other families both loadplan's engine and SGLang build (the engine tests' tiny configs)
                  "tiny-afmoe", "tiny-cohere2moe", "tiny-deepseekv2", "tiny-deepseekv32", "tiny-ernie4_5_moe",
                  "tiny-glm4vmoe", "tiny-glmmoedsa", "tiny-granitemoe", "tiny-granitemoehybrid", "tiny-granitemoeswa",
                  "tiny-granitemoeshared", "tiny-hyv3", "tiny-hunyuanmoev1", "tiny-kimilinear", "tiny-laguna",
                  "tiny-lfm2moe", "tiny-llama4", "tiny-longcatflash", "tiny-mellum", "tiny-olmoe", "tiny-dbrx",
                  "tiny-step3p7",
                  # MiniMax-M3's quantized checkpoints, whose runner and a2a backend its override picks per device
                  "tiny-minimax-m3-nvfp4", "tiny-minimax-m3-mxfp8",
                  # ModelOpt's formats, named from quant_algo (modelopt_fp8, modelopt_fp4)
                  "tiny-deepseek-v3-modelopt-fp8", "tiny-deepseek-v3-modelopt-fp4",
                  # quantized checkpoints whose family override picks the runner on SM100
                  "tiny-mimo-v2-flash-fp8", "tiny-minimax-m2-modelopt-fp4"]
# Minimal configs of the classes whose Qwen2-MoE block decides its own fusion, and the backends it reads.
CONFIGS_QWEN_BLOCK = ["tiny-qwen3-next", "tiny-qwen3-next-unshared", "tiny-qwen3_5-moe", "tiny-minicpmv4_6"]
A2A_QWEN_BLOCK = ["none", "deepep", "deepep_v2", "mori", "mooncake", "megamoe", "nixl", "flashinfer"]


def grid() -> list[dict]:
    points: list[dict] = []

    def add(subgrid, **p):
        points.append({"grid": subgrid, **p})

    for cfgs, flagsets in ((CONFIGS_SHARED, FLAGS_SHARED), (CONFIGS_UNSHARED, FLAGS_UNSHARED)):
        for cfg, backend, device, (tp, ep, dp), flags in itertools.product(
                cfgs, A2A_BACKENDS, DEVICES, SHAPES, flagsets):
            add("main", config=cfg, a2a_backend=backend, device=device, tp=tp, ep=ep, dp=dp, **flags)
    for cfg, runner, device in itertools.product(CONFIGS_SHARED, RUNNERS, DEVICES):
        add("runner", config=cfg, a2a_backend="none", moe_runner_backend=runner, device=device,
            tp=8, ep=1, dp=1)
    for cfg, pp in itertools.product(CONFIGS_SHARED + CONFIGS_UNSHARED, PP_SIZES):
        add("pipeline", config=cfg, a2a_backend="none", device="cuda:9.0", tp=8, ep=1, dp=1, pp=pp)
    for cfg, backend in itertools.product(CONFIGS_SHARED + CONFIGS_UNSHARED, ["none", "deepep"]):
        add("eplb", config=cfg, a2a_backend=backend, device="cuda:9.0", tp=1, ep=8, dp=1, eplb=True)
    for (target, draft), device, eplb in itertools.product(DRAFTS, DEVICES, [False, True]):
        for role_draft in (None, draft):
            add("draft", config=target, draft_config=role_draft, a2a_backend="none", device=device,
                tp=1, ep=8, dp=1, eplb=eplb)
    for (target, draft), device, with_draft in itertools.product(DRAFTS, DEVICES, (False, True)):
        # one tp group, no EP: where a NextN draft's fusion follows the server's MoE runner (SM100's trtllm)
        add("draft", config=target, draft_config=draft if with_draft else None, a2a_backend="none", device=device,
            tp=8, ep=1, dp=1)
    for cfg, backend, (tp, ep), flags in itertools.product(CONFIGS_ENTRIES, ["none", "deepep"], [(8, 1), (2, 4)],
                                                          [{}, {"enforce_fusion": True}]):
        add("entries", config=cfg, a2a_backend=backend, device="cuda:9.0", tp=tp, ep=ep, dp=1, **flags)
    for cfg, backend, device, (tp, ep, dp) in itertools.product(CONFIGS_BLOCKS, A2A_BACKENDS, DEVICES, SHAPES):
        add("blocks", config=cfg, a2a_backend=backend, device=device, tp=tp, ep=ep, dp=dp)
    for cfg, backend, device, (tp, ep), flags in itertools.product(
            CONFIGS_QWEN_BLOCK, A2A_QWEN_BLOCK, DEVICES, [(8, 1), (2, 4)],
            [{}, {"disable_fusion": True}, {"enforce_fusion": True}]):
        add("qwen_block", config=cfg, a2a_backend=backend, device=device, tp=tp, ep=ep, dp=1, **flags)
    for cfg, backend, device, (tp, ep), env in itertools.product(
            CONFIGS_QWEN_BLOCK + ["qwen1.5-moe-a2.7b", "deepseek-v3"], ["none", "mooncake", "deepep"],
            DEVICES_ENGINE_ENV, [(8, 1), (2, 4)], ENGINE_ENVS):
        add("engine_env", config=cfg, a2a_backend=backend, device=device, tp=tp, ep=ep, dp=1, engine_env=env)
    return points


def run_device(python: str, oracle_args: tuple[str, ...], points: list[dict], results: dict, progress: list) -> None:
    device = " ".join(oracle_args)
    proc = subprocess.Popen([python, str(ORACLE), *oracle_args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)

    def feed():
        for p in points:
            proc.stdin.write(json.dumps(p) + "\n")
        proc.stdin.close()

    threading.Thread(target=feed, daemon=True).start()
    ready = json.loads(proc.stdout.readline())
    results["_ready_" + device] = ready
    for i, line in enumerate(proc.stdout):
        rec = json.loads(line)
        results[json.dumps(points[i], sort_keys=True)] = rec["answer"]
        progress[0] += 1
    if proc.wait() != 0:
        raise RuntimeError(f"oracle for {device} exited {proc.returncode}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default=NEWEST,
                        help=f"the SGLang release whose code answers (default {NEWEST}): its environment "
                             f"(`make sglang-env`: .venv-sglang-<release>) and its recording "
                             f"(tests/data/sglang_<release>_grid.jsonl.gz)")
    parser.add_argument("--python", default="", help="the SGLang environment's python (default: the release's)")
    parser.add_argument("--out", type=Path, default=None, help="default: the release's recording")
    parser.add_argument("--limit", type=int, default=0, help="record only the first N points per device")
    parser.add_argument("--only", default="", help="record only this sub-grid, replacing its points in --out")
    args = parser.parse_args(argv)
    args.python = args.python or str(environment(args.release) / "bin" / "python")
    args.out = args.out or recording(args.release)

    points = [p for p in grid() if not args.only or p["grid"] == args.only]
    by_device: dict[tuple[str, ...], list[dict]] = {}
    for p in points:       # one oracle process per device and environment
        by_device.setdefault(oracle_args(p), []).append(p)
    if args.limit:
        by_device = {d: ps[: args.limit] for d, ps in by_device.items()}
    total = sum(len(ps) for ps in by_device.values())
    print(f"{total} points over {len(by_device)} devices", flush=True)
    results: dict = {}
    progress = [0]
    started = time.time()
    threads = [threading.Thread(target=run_device, args=(args.python, d, ps, results, progress))
               for d, ps in by_device.items()]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(10)
        print(f"  {progress[0]}/{total} in {time.time() - started:.0f} s", flush=True)
    for t in threads:
        t.join()
    missing = total - progress[0]
    if missing:
        print(f"{missing} points got no answer", file=sys.stderr)
        return 1
    ready = [results.pop(k) for k in sorted(k for k in results if k.startswith("_ready_"))]
    recorded = {}
    if args.only:       # keep every other sub-grid's recorded points and answers, and their date
        with gzip.open(args.out, "rt") as f:
            old = json.loads(f.readline())
            for line in f:
                rec = json.loads(line)
                if rec["point"]["grid"] != args.only:
                    results[json.dumps(rec["point"], sort_keys=True)] = rec["answer"]
        total = len(results)
        recorded = {k: v for k, v in old.items() if k.startswith("recorded_at")}
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    header = {
        "sglang": ready[0]["sglang"],
        "script": "scripts/record_sglang_grid.py",
        "oracle": "tests/conformance/sglang_oracle.py",
        "recorded_at": recorded.get("recorded_at", now),
        **{k: v for k, v in recorded.items() if k != "recorded_at"},
        **({f"recorded_at_{args.only}": now} if args.only else {}),
        "points": total,
        "inputs": {
            "configs_shared": CONFIGS_SHARED, "configs_unshared": CONFIGS_UNSHARED,
            "a2a_backends": A2A_BACKENDS, "devices": DEVICES, "shapes_tp_ep_dp": SHAPES,
            "flags_shared": FLAGS_SHARED, "flags_unshared": FLAGS_UNSHARED,
            "runners": RUNNERS, "pp_sizes": PP_SIZES, "drafts": DRAFTS, "limit": args.limit,
            "configs_entries": CONFIGS_ENTRIES, "configs_qwen_block": CONFIGS_QWEN_BLOCK,
            "configs_blocks": CONFIGS_BLOCKS, "a2a_qwen_block": A2A_QWEN_BLOCK,
        },
        "environment": "the oracle's DISPATCH_BUDGETS (per-rank dispatch-token budgets of "
                       "MoRI, pplx and DeepEP v2, set as an operator sets them)",
        "shape_mapping": "loadplan (tp, ep, dp) -> SGLang --tp-size tp*ep --ep-size ep "
                         "[--dp-size dp --enable-dp-attention when dp > 1]",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    with gzip.open(tmp, "wt") as f:
        f.write(json.dumps(header, sort_keys=True) + "\n")
        for key in sorted(results):
            f.write(json.dumps({"point": json.loads(key), "answer": results[key]}, sort_keys=True) + "\n")
    tmp.replace(args.out)
    refused = sum(1 for a in results.values() if a.get("refused"))
    errors = sum(1 for a in results.values() if "error" in a)
    print(f"wrote {args.out}: {total} points, {refused} refused by SGLang, "
          f"{errors} oracle errors, {time.time() - started:.0f} s")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
