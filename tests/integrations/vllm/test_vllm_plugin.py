"""The entry point as vLLM calls it, in the project's .venv (which has no vLLM)."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_distribution_registers_the_plugin_in_vllms_group():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"loadplan": "loadplan.integrations.vllm:register"}
    assert project["optional-dependencies"]["vllm"] == []     # the client alone: no torch, no vLLM


def test_inert_without_a_registry_imports_nothing_of_vllm_or_grpc():
    code = ("import sys\nfrom loadplan.integrations.vllm import register\nassert register() is None\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in {'vllm', 'grpc', 'torch'}))")
    env = {k: v for k, v in os.environ.items() if k != "LOADPLAN_REGISTRY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def test_active_without_vllm_fails_loudly():
    code = "from loadplan.integrations.vllm import register\nregister()"
    env = dict(os.environ, LOADPLAN_REGISTRY="127.0.0.1:1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode != 0 and "No module named 'vllm'" in out.stderr
