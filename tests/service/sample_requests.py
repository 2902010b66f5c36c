"""Requests for transport, client and CLI tests: small synthetic configs and the checked-in real ones."""

from __future__ import annotations

import json
import pathlib
import uuid
from typing import Any

from loadplan.plan import Parallel, ResolveRequest, Runtime

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "data" / "configs"


def deepseek_config(**overrides: Any) -> dict[str, Any]:
    """A small DeepSeek-V3 shaped config: 4 layers (1 dense), 256 routed experts, 1 shared."""
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 32,
        "routed_scaling_factor": 2.5,
    }
    cfg.update(overrides)
    return cfg


def real_config(name: str) -> dict[str, Any] | None:
    path = CONFIGS / name / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def request(config: dict[str, Any] | None = None, *, request_id: str | None = None, deployment_id: str = "dep-1",
            role: str = "target", parallel: Parallel = Parallel(), runtime: Runtime = Runtime(),
            **kw: Any) -> ResolveRequest:
    return ResolveRequest(request_id=request_id or uuid.uuid4().hex, deployment_id=deployment_id, role=role,
                          parallel=parallel, config=config if config is not None else deepseek_config(),
                          runtime=runtime, **kw)


def decided(req: ResolveRequest) -> ResolveRequest:
    """`req` as the registry stores and answers it: its runtime names the engine that decided."""
    from loadplan.service.rules.resolve import resolve_decisions

    return resolve_decisions(req).request
