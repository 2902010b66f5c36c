"""Request builders shared by the rules tests: small synthetic configs per family,
and the real public config.json files under tests/data/configs."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

from loadplan.plan import Keys, Parallel, ResolveRequest, Runtime
from loadplan.service.rules.resolve import Resolution, resolve_decisions

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"
REAL_CONFIGS = ("deepseek-v3", "kimi-k2", "glm-4.5", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "kimi-k2.5", "mixtral-8x7b",
                "gpt-oss-20b")

_PARALLEL = {f.name for f in dataclasses.fields(Parallel)}
_RUNTIME = {f.name for f in dataclasses.fields(Runtime)}


def load_config(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / name / "config.json").read_text())


def deepseek(**over: Any) -> dict[str, Any]:
    """A small DeepSeek-V3-shaped config: 4 layers, the first dense, 256 routed + 1 shared."""
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4, "n_routed_experts": 256,
           "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1}
    cfg.update(over)
    return cfg


def glm4(**over: Any) -> dict[str, Any]:
    cfg = {"architectures": ["Glm4MoeForCausalLM"], "num_hidden_layers": 6, "n_routed_experts": 160,
           "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3}
    cfg.update(over)
    return cfg


def qwen2(**over: Any) -> dict[str, Any]:
    cfg = {"architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 4, "num_experts": 64,
           "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 1408}
    cfg.update(over)
    return cfg


def qwen3(**over: Any) -> dict[str, Any]:
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4, "num_experts": 128,
           "num_experts_per_tok": 8}
    cfg.update(over)
    return cfg


def mixtral(**over: Any) -> dict[str, Any]:
    cfg = {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 4, "num_local_experts": 8,
           "num_experts_per_tok": 2}
    cfg.update(over)
    return cfg


def kimi_k25(text_config: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    body = deepseek(n_routed_experts=384) if text_config is None else text_config
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": copy.deepcopy(body)}
    cfg.update(over)
    return cfg


def request(config: dict[str, Any], *, request_id: str = "req-1", deployment_id: str = "dep-1",
            role: str = "target", host: str = "", quantization: str | None = None,
            quantization_config: dict[str, Any] | None = None, **knobs: Any) -> ResolveRequest:
    """Keyword arguments named like a `Parallel` or `Runtime` field go there."""
    unknown = set(knobs) - _PARALLEL - _RUNTIME
    assert not unknown, f"unknown knobs {unknown}"
    return ResolveRequest(
        request_id=request_id, deployment_id=deployment_id, role=role, host=host,
        config=copy.deepcopy(config), quantization=quantization, quantization_config=quantization_config,
        parallel=Parallel(**{k: v for k, v in knobs.items() if k in _PARALLEL}),
        runtime=Runtime(**{k: v for k, v in knobs.items() if k in _RUNTIME}),
    )


def real_request(name: str, **kw: Any) -> ResolveRequest:
    """A real checkpoint as the CLI sends it: config.json plus its quantization_config."""
    cfg = load_config(name)
    kw.setdefault("quantization_config", cfg.get("quantization_config"))
    return request(cfg, **kw)


def resolve(config: dict[str, Any], **kw: Any) -> Resolution:
    return resolve_decisions(request(config, **kw))


def fusion(config: dict[str, Any], **kw: Any):
    """The moe.shared_experts_fusion decision."""
    return resolve(config, **kw).decisions[Keys.SHARED_EXPERTS_FUSION]
