"""The registry's answers for engine vllm against each profiled vLLM release's own decision code (0.31.0, 0.32.0).

vllm_decisions.py runs in the vLLM env and asks vLLM (FusedMoEParallelConfig.make, the
prepare/finalize class's output_is_reduced(), resolve_layer_fused_shared_expert, get_pp_indices);
each test resolves the same runner with the registry's rules (`runtime.engine = "vllm"`, the
request the plugin sends) and lists every case where the two differ. What cannot be called on a
CPU is pinned to vLLM's source in test_vllm_source_pins.py.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from loadplan.plan import ENGINE_VLLM, Keys, Parallel, ResolveRequest, Runtime
from loadplan.service.registry import Registry
from loadplan.service.rules import vllm as vllm_rules

from vllm_env import vllm_python

QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
             "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "intermediate_size": 96, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 128}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 32,
               "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "moe_intermediate_size": 16, "intermediate_size": 48, "n_group": 8,
               "topk_group": 4, "topk_method": "noaux_tc", "moe_layer_freq": 1, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "vocab_size": 128}


class _Memory:
    def save_plan(self, new):
        return new.plan


@pytest.fixture(scope="module", params=sorted(vllm_rules.RELEASES))
def vllm_answers(request, tmp_path_factory) -> dict:
    done = subprocess.run([str(vllm_python(request.param)), str(Path(__file__).with_name("vllm_decisions.py"))],
                          cwd=tmp_path_factory.mktemp("vllm-decisions"), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    answers = json.loads(done.stdout.splitlines()[-1])
    assert answers["version"] == request.param
    return answers


def resolve(config: dict, *, device: str = "cuda:9.0", a2a_backend: str = "allgather_reducescatter",
            parallel: Parallel = Parallel(), release: str = ""):
    request = ResolveRequest(request_id=uuid.uuid4().hex, deployment_id=uuid.uuid4().hex, config=config,
                             parallel=parallel,
                             runtime=Runtime(engine=ENGINE_VLLM, engine_version=release, a2a_backend=a2a_backend,
                                             device=device))
    return Registry(_Memory()).resolve(request)


def registry_answer(case: dict, key: str, release: str):
    parallel = Parallel(tp_size=case["tp"], dp_size=case["dp"], ep_size=case["moe_ep_size"],
                        ep_rank=case["moe_ep_rank"])
    try:
        return resolve(QWEN3_MOE, a2a_backend=case["vllm_backend"], parallel=parallel,
                       release=release).value(key)
    except Exception as e:        # a refusal is an answer that differs from vLLM's
        return f"{type(e).__name__}: {e}"


def mismatches(answers: dict, key: str, field: str) -> list[str]:
    out = []
    for c in answers["cases"]:
        ours = registry_answer(c, key, answers["version"])
        if ours != c[field]:
            out.append(f"{c['backend']} tp={c['tp']} dp={c['dp']} ep={c['ep']}: vLLM {c[field]!r} "
                       f"({c['prepare_finalize']}), registry {ours!r}")
    return out


def test_the_forward_path_is_vllms_use_all2all_kernels(vllm_answers):
    assert mismatches(vllm_answers, Keys.FORWARD_PATH, "forward_path") == []


def test_the_reduction_after_the_experts_is_vllms(vllm_answers):
    """MoERunner all-reduces iff the MoE is split (tp or ep > 1) and output_is_reduced() is false."""
    assert mismatches(vllm_answers, Keys.POST_EXPERTS_ALL_REDUCE, "post_experts_all_reduce") == []


def test_vllm_reduces_exactly_where_its_kernel_does_not(vllm_answers):
    """The oracle itself: DeepEP HT/LL, MoRI, NIXL-EP, the FlashInfer NVLink kernels and PassThrough
    reduce; the naive and allgather_reducescatter kernels and the no-all2all path do not."""
    reduced = {c["prepare_finalize"] for c in vllm_answers["cases"] if c["output_is_reduced"]}
    not_reduced = {c["prepare_finalize"] for c in vllm_answers["cases"] if not c["output_is_reduced"]}
    assert reduced == {"DeepEPHTPrepareAndFinalize", "DeepEPLLPrepareAndFinalize", "DeepEPV2PrepareAndFinalize",
                       "MoonEPPrepareAndFinalize", "MoriPrepareAndFinalize", "NixlEPPrepareAndFinalize",
                       "FlashInferNVLinkTwoSidedPrepareAndFinalize", "FlashInferNVLinkOneSidedPrepareAndFinalize",
                       *(["PassThroughPrepareAndFinalize"] if vllm_answers["version"] != "0.31.0" else [])}
    assert not_reduced == {"MoEPrepareAndFinalizeNoDPEPModular", "MoEPrepareAndFinalizeNaiveDPEPModular"}


@pytest.mark.parametrize("device", ["cpu", "cuda:9.0", "cuda:10.0"])
def test_deepseek_shared_expert_is_unfused_off_rocm(vllm_answers, device):
    """resolve_layer_fused_shared_expert fuses only with ROCm AITER (source pin); on this CPU it says no."""
    assert vllm_answers["cpu_fused_shared_expert"] is False
    plan = resolve(DEEPSEEK_V3, device=device, release=vllm_answers["version"])
    assert (plan.value(Keys.SHARED_EXPERTS_FUSION), plan.value(Keys.NUM_FUSED_SHARED_EXPERTS)) == (False, 0)


def test_pipeline_stages_are_vllms_get_pp_indices(vllm_answers):
    out = []
    for shape, ranges in vllm_answers["pp"].items():
        n, size = map(int, shape.split("/"))
        config = dict(QWEN3_MOE, num_hidden_layers=n)
        for rank, expected in enumerate(ranges):
            ours = resolve(config, parallel=Parallel(pp_size=size, pp_rank=rank),
                           release=vllm_answers["version"]).value(Keys.PP_LAYER_RANGE)
            if list(ours) != expected:
                out.append(f"{n} layers, stage {rank}/{size}: vLLM {expected}, registry {list(ours)}")
    assert out == []


def test_the_backends_the_registry_accepts_are_the_releases_own(vllm_answers):
    """Every backend vLLM's Literal names and makes a prepare/finalize for is accepted, and no other (pplx, which
    vLLM names without one, aside)."""
    vllm_names = {c["backend"] for c in vllm_answers["cases"]} - {"pplx"}
    assert vllm_names == set(vllm_rules.RELEASES[vllm_answers["version"]])
