"""A vLLM release without a profile starts: the plugin lets vLLM decide and the registry records an observed plan.

vllm_observed.py runs the plugin's start path in the vLLM env on vLLM's own ParallelConfig and model class, as a
release the registry has no profile of (it reports 0.33.0; vLLM 0.32.0's code decides): the registry answers
NOT_FOUND for runtime.engine_version, the plugin sends what vLLM decided, and the plan is stored as observed.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from loadplan.client import RegistryClient
from loadplan.plan import Keys

from vllm_env import make_qwen3_moe, serving, vllm_python

HERE = Path(__file__).parent


@pytest.fixture
def registry(tmp_path):
    """`loadplan serve` on a fresh SQLite history; its address."""
    with serving(f"sqlite:///{tmp_path / 'h.db'}") as address:
        yield address


def test_an_unprofiled_vllm_release_starts_and_leaves_an_observed_plan(registry, tmp_path):
    checkpoint = make_qwen3_moe(tmp_path)
    done = subprocess.run([str(vllm_python()), str(HERE / "vllm_observed.py"), registry, str(checkpoint),
                           "vllm-unprofiled", "0.33.0"], cwd=HERE, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["observed"] is True
    with RegistryClient(registry) as client:
        plan = client.get_plan(out["plan_id"])
        [stored] = list(client.iter_plans(deployment_id="vllm-unprofiled"))
    assert stored.plan_id == plan.plan_id and plan.observed
    assert (plan.request.runtime.engine, plan.request.runtime.engine_version) == ("vllm", "0.33.0")
    assert plan.value(Keys.ENGINE_PROFILE) == "vllm 0.33.0 (observed)"
    # what vLLM's own code decided for one worker without all2all kernels, as the plugin read it
    for key, value in ((Keys.FORWARD_PATH, "normal"), (Keys.POST_EXPERTS_ALL_REDUCE, False),
                       (Keys.SHARED_EXPERTS_FUSION, False), (Keys.NUM_FUSED_SHARED_EXPERTS, 0)):
        d = plan.decisions[key]
        assert (d.value, d.rule) == (value, "observed.vllm"), key
        assert key == Keys.NUM_FUSED_SHARED_EXPERTS or d.reason.startswith("vLLM built it: "), d.reason
    # the rest as the nearest profiled release decides, and still compared with what vLLM builds
    layers = plan.decisions[Keys.PP_LAYER_RANGE]
    assert list(layers.value) == [0, 2] and "vllm 0.32.0's profile" in layers.reason
