import json
import subprocess
from pathlib import Path

from loadplan.integrations.vllm.identity import Served, WorkerIdentity, default_deployment, resolve_request
from loadplan.plan import ENGINE_VLLM, ROLE_SPECULATIVE, Parallel

from vllm_env import vllm_python

CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8}


def test_the_request_carries_vllms_identity_with_engine_vllm():
    identity = WorkerIdentity(model="/m", config=CONFIG, role=ROLE_SPECULATIVE,
                              parallel=Parallel(tp_size=2, tp_rank=1, ep_size=4, ep_rank=3, dp_size=2, dp_rank=1),
                              device="cuda:9.0", a2a_backend="deepep_low_latency", enable_eplb=True,
                              ep_num_redundant_experts=8, engine_version="0.32.0")
    req = resolve_request(identity, "prod")
    assert (req.deployment_id, req.role, req.parallel) == ("prod", ROLE_SPECULATIVE, identity.parallel)
    rt = req.runtime
    assert (rt.engine, rt.engine_version, rt.a2a_backend, rt.device, rt.enable_eplb,
            rt.ep_num_redundant_experts) == (ENGINE_VLLM, "0.32.0", "deepep_low_latency", "cuda:9.0", True, 8)
    assert dict(req.config) == CONFIG and req.quantization is None and req.quantization_config is None
    assert req.request_id != resolve_request(identity, "prod").request_id      # one request per start


def test_the_checkpoints_quantization_config_goes_along_and_online_quantization_by_name():
    quantized = dict(CONFIG, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    req = resolve_request(WorkerIdentity(model="/m", config=quantized))
    assert req.quantization_config == quantized["quantization_config"]
    assert resolve_request(WorkerIdentity(model="/m", config=CONFIG, quantization="fp8")).quantization == "fp8"


def test_redundant_experts_only_with_eplb():
    req = resolve_request(WorkerIdentity(model="/m", config=CONFIG, ep_num_redundant_experts=8))
    assert req.runtime.ep_num_redundant_experts == 0


def test_the_default_deployment_is_shared_by_the_ranks_of_one_layout_only():
    def rank(tp_rank, **sizes):
        return WorkerIdentity(model="/m", config=CONFIG, parallel=Parallel(tp_rank=tp_rank, **sizes))

    assert default_deployment(rank(0, tp_size=2)) == default_deployment(rank(1, tp_size=2))
    assert default_deployment(rank(0, tp_size=2)) != default_deployment(rank(0, tp_size=2, ep_size=2))
    assert default_deployment(rank(0)) != default_deployment(WorkerIdentity(model="/other", config=CONFIG))
    assert resolve_request(rank(0, tp_size=2)).deployment_id == default_deployment(rank(0, tp_size=2))
    json.dumps(default_deployment(rank(0)))


def test_a_drafts_default_deployment_is_its_targets():
    """A draft is built in its target's workers under its own model, EP and all2all backend: the
    default deployment is named by the served model and its layout, so both roles share it."""
    parallel = Parallel(tp_size=2, tp_rank=1, ep_size=4, ep_rank=3, dp_size=2, dp_rank=1)
    target = WorkerIdentity(model="/target", config=CONFIG, parallel=parallel, a2a_backend="deepep_low_latency")
    draft = WorkerIdentity(model="/draft", config=CONFIG, role=ROLE_SPECULATIVE,
                           parallel=Parallel(tp_size=2, tp_rank=1, dp_size=2, dp_rank=1),
                           served=Served(model="/target", tp_size=2, ep_size=4, dp_size=2,
                                         a2a_backend="deepep_low_latency"))
    assert default_deployment(draft) == default_deployment(target)
    assert default_deployment(draft) != default_deployment(WorkerIdentity(model="/draft", config=CONFIG,
                                                                         parallel=draft.parallel))
    assert resolve_request(draft).deployment_id == resolve_request(target).deployment_id


def test_identity_of_reads_the_worker_groups_not_the_drafts_parallel_config(tmp_path):
    """vLLM builds a draft model under its own ParallelConfig (one pipeline stage, one DP rank) in
    the target's workers: on the last pipeline stage or DP rank the draft's identity must carry the
    groups' sizes and ranks, as the target's does (a rank beyond its size is refused by the
    registry), and the target's default deployment. vllm_identity.py runs vLLM's config code."""
    for name, layers in (("target", 2), ("draft", 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(dict(CONFIG, model_type="qwen3_moe",
                                                                     num_hidden_layers=layers)))
    done = subprocess.run([str(vllm_python()), str(Path(__file__).with_name("vllm_identity.py")), str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(done.stdout.splitlines()[-1])
    assert len(rows) >= 2
    for row in rows:
        target, draft, layout = row["target"], row["draft"], row["layout"]
        # what makes the case: vLLM's ParallelConfig of the draft does not have the groups' sizes
        assert [k for k, size in row["draft_parallel_config"].items() if size != layout.get(k, 1)], row
        assert (target["role"], draft["role"]) == ("target", ROLE_SPECULATIVE)
        assert draft["model"] != target["model"]
        mine, theirs = draft["parallel"], target["parallel"]
        for axis in ("tp", "pp", "dp"):
            assert (mine[f"{axis}_size"], mine[f"{axis}_rank"]) == (theirs[f"{axis}_size"], theirs[f"{axis}_rank"]), row
            assert 0 <= mine[f"{axis}_rank"] < mine[f"{axis}_size"]
        if row["draft_is_moe"]:
            assert mine == theirs, row
        assert draft["deployment"] == target["deployment"], row
