import json

from loadplan.integrations.vllm.identity import WorkerIdentity, default_deployment, resolve_request
from loadplan.plan import ENGINE_VLLM, ROLE_SPECULATIVE, Parallel

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
