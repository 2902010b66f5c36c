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


def fake_vllm(root: Path) -> Path:
    """Just the model-loader modules the plugin hooks, laid out as vLLM lays them out."""
    loader = root / "vllm" / "model_executor" / "model_loader"
    loader.mkdir(parents=True)
    for package in (root / "vllm", root / "vllm" / "model_executor", loader):
        (package / "__init__.py").write_text("")
    (loader / "utils.py").write_text(
        "def initialize_model(vllm_config, *, prefix='', model_class=None, model_config=None):\n"
        "    return 'built'\n")
    (loader / "base_loader.py").write_text("from vllm.model_executor.model_loader.utils import initialize_model\n")
    return root


def run_with(root: Path, code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env=dict(os.environ, PYTHONPATH=str(root), **env))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_active_hooks_the_loader_when_vllm_first_imports_it(tmp_path):
    """register() runs before the model loader is imported (vLLM's front end and engine core never
    import it): the hook lands as it is imported, on both names base_loader builds with, once
    however often vLLM registers the plugin."""
    code = ("import sys\nfrom loadplan.integrations.vllm import register\nregister()\nregister()\n"
            "assert 'vllm.model_executor.model_loader.utils' not in sys.modules\n"
            "from vllm.model_executor.model_loader import base_loader, utils\n"
            "hooked = utils.initialize_model\n"
            "print(hooked is base_loader.initialize_model, hooked.loadplan_settings.registry, "
            "hasattr(hooked.__wrapped__, 'loadplan_settings'))")
    assert run_with(fake_vllm(tmp_path), code, LOADPLAN_REGISTRY="registry:50051") == "True registry:50051 False"


def test_active_after_the_loader_was_imported_hooks_it_in_place(tmp_path):
    code = ("from vllm.model_executor.model_loader import base_loader, utils\n"
            "from loadplan.integrations.vllm import register\nregister()\n"
            "print(utils.initialize_model is base_loader.initialize_model, "
            "utils.initialize_model.loadplan_settings.registry)")
    assert run_with(fake_vllm(tmp_path), code, LOADPLAN_REGISTRY="r:1") == "True r:1"


def test_inert_leaves_the_loader_alone(tmp_path):
    code = ("from loadplan.integrations.vllm import register\nregister()\n"
            "from vllm.model_executor.model_loader import utils\n"
            "print(hasattr(utils.initialize_model, 'loadplan_settings'))")
    env = {k: v for k, v in os.environ.items() if k != "LOADPLAN_REGISTRY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=fake_vllm(tmp_path),
                         env=dict(env, PYTHONPATH=str(tmp_path)))
    assert out.stdout.strip() == "False", out.stderr
