"""SGLang's side of the adapter tests: runs in the SGLang environment (`.venv-sglang`).

Starts runners the way SGLang's scheduler does (publish the server args for a rank,
initialize_moe_config, ModelConfig, the architecture, the loader's quantization config)
and calls the loader's shared-experts step through the name SGLang's loader calls
(`sglang.srt.model_loader.loader.resolve_shared_experts_config` from 0.5.23,
`...install_shared_experts_fusion_decision` before), for a draft inside
`draft_model_build_scope()`. Prints one JSON line per runner with what SGLang got (the
SharedExpertsConfig, or the flag the older step installs and the fused experts the model
counts from it), or the error that stopped the runner.

    sglang_runner.py [--device cuda:9.0] --run SCENARIO:DEPLOYMENT[@REGISTRY] [--run ...]

A run with @REGISTRY installs the adapter in-process first (loadplan.integrations.sglang.install,
pointed at REGISTRY); one without it needs the adapter already active (a process started by
`loadplan sglang-run`). Runs go in order, in one process (SGLang's import is paid once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "conformance"))

import sglang_cpu  # noqa: E402

CONFIGS = {
    "deepseek-v3": ROOT / "tests" / "data" / "configs" / "deepseek-v3",
    "kimi-k2": ROOT / "tests" / "data" / "configs" / "kimi-k2",
    "qwen3-0.6b": ROOT / "tests" / "conformance" / "configs" / "qwen3-0.6b",
    "qwen3-next": ROOT / "tests" / "conformance" / "configs" / "tiny-qwen3-next",
}

# scenario -> (target config, draft config or None, SGLang server args, world ranks)
SCENARIOS = {
    # DeepSeek-V3 on tp 2 x ep 2 (SGLang --tp-size 4 --ep-size 2) with a Qwen3 draft model.
    "dsv3_with_qwen3_draft": ("deepseek-v3", "qwen3-0.6b", dict(tp_size=4, ep_size=2), range(4)),
    # DeepSeek-V3 on one 8-GPU tp group, no draft: SGLang would fuse on SM90.
    "dsv3_tp8": ("deepseek-v3", None, dict(tp_size=8), range(1)),
    # Qwen3-Next on one 8-GPU tp group: its Qwen2-MoE block fuses on CUDA by itself (no loader hooks).
    "qwen3_next_tp8": ("qwen3-next", None, dict(tp_size=8), range(1)),
    # Kimi-K2 (384 experts, FP8) with --enforce-shared-experts-fusion: SGLang's own comment says
    # the fused path then mis-loads the shared expert; the registry lists it as a hazard.
    "kimi_k2_enforced": ("kimi-k2", None, dict(tp_size=8, enforce_shared_experts_fusion=True), range(1)),
    # DeepSeek-V3's 61 layers in two pipeline stages (--pp-size 2): SGLang's default partition, 30 + 31 ...
    "dsv3_pp2": ("deepseek-v3", None, dict(tp_size=1, pp_size=2), range(2)),
    # ... the same stages spelled out by SGLANG_PP_LAYER_PARTITION (below) ...
    "dsv3_pp2_default_partition": ("deepseek-v3", None, dict(tp_size=1, pp_size=2), range(2)),
    # ... and the stages it asks for instead: 20 + 41.
    "dsv3_pp2_partition": ("deepseek-v3", None, dict(tp_size=1, pp_size=2), range(2)),
}

# The environment a scenario runs under (set for its runners, then restored).
SCENARIO_ENV = {"dsv3_pp2_default_partition": {"SGLANG_PP_LAYER_PARTITION": "30,31"},
                "dsv3_pp2_partition": {"SGLANG_PP_LAYER_PARTITION": "20,41"}}


def run(scenario: str, registry: str | None, deployment: str) -> list[dict]:
    with mock.patch.dict(os.environ, SCENARIO_ENV.get(scenario, {})):   # restored after, as it was
        return _run(scenario, registry, deployment)


def _run(scenario: str, registry: str | None, deployment: str) -> list[dict]:
    from sglang.srt import runtime_context
    from sglang.srt.runtime_context import get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    from loadplan.integrations import sglang as adapter

    if registry:
        adapter.install(registry, deployment=deployment, timeout=20)
    target, draft, server_kwargs, ranks = SCENARIOS[scenario]
    out = []
    for world_rank in ranks:
        kwargs = dict(model_path=str(CONFIGS[target]), skip_tokenizer_init=True, load_format="dummy",
                      **server_kwargs)
        if draft:
            kwargs.update(speculative_algorithm="STANDALONE", speculative_draft_model_path=str(CONFIGS[draft]),
                          speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2)
        server_args = ServerArgs(**kwargs)
        reset_context()
        if hasattr(runtime_context, "SpawnRanks"):
            publish(server_args, role="scheduler",
                    ranks=runtime_context.SpawnRanks(world_rank=world_rank, gpu_id=world_rank))
            ranks_scope = contextlib.nullcontext()
        else:   # 0.5.20 and before read ranks and widths off the process groups, which this process does not build
            publish(server_args, role="scheduler")
            # the widths initialize_model_parallel stamps, by SGLang's own arithmetic
            get_parallel().stamp_derived_widths(**runtime_context.derive_parallel_widths(
                tp_size=server_args.tp_size, attn_cp_size=1,
                attn_dp_size=server_args.dp_size if server_args.enable_dp_attention else 1,
                moe_ep_size=server_args.ep_size or 1, moe_dp_size=1, dcp_size=1, dcp_enabled=False))
            ranks_scope = get_parallel().override(**_ranks(world_rank, server_args))
        with ranks_scope:
            out.extend(_runners(scenario, world_rank, server_args, draft, adapter))
    return out


def _ranks(world_rank: int, server_args) -> dict:
    """A world rank's ranks as SGLang's later SpawnRanks derives them (tp inside pp, MoE ep over moe tp)."""
    tp, ep = server_args.tp_size, server_args.ep_size or 1
    tp_rank = world_rank % tp
    moe_tp = tp // ep
    return dict(pp_rank=world_rank // tp, tp_rank=tp_rank, moe_ep_rank=tp_rank // moe_tp, moe_tp_rank=tp_rank % moe_tp,
                attn_dp_rank=0, attn_tp_rank=tp_rank)


def _runners(scenario: str, world_rank: int, server_args, draft, adapter) -> list[dict]:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import get_pp_indices
    from sglang.srt.layers.moe import utils as moe_utils
    from sglang.srt.model_loader import loader
    from sglang.srt.model_loader.loader import _get_quantization_config
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt.runtime_context import get_parallel

    moe_utils.initialize_moe_config()
    runners = [("target", ModelConfig.from_server_args(server_args))]
    if draft:
        runners.append(("speculative", ModelConfig.from_server_args(
            server_args, model_path=str(CONFIGS[draft]), is_draft_model=True)))
    out = []
    for role, model_config in runners:
        model_class, _ = get_model_architecture(model_config)
        quant_config = _get_quantization_config(model_config, LoadConfig(load_format="dummy"))
        record = {"scenario": scenario, "world_rank": world_rank, "role": role, "entry_class": model_class.__name__,
                  "adapter_active": adapter.installed()}
        if role == "target":   # the layers SGLang builds on this rank's stage (a draft's stage holds all)
            par = get_parallel()
            record.update(pp_rank=par.pp_rank, sglang_layer_range=list(get_pp_indices(
                model_config.num_hidden_layers, par.pp_rank, par.pp_size)))
        try:
            scope = moe_utils.draft_model_build_scope() if role == "speculative" else contextlib.nullcontext()
            with scope:
                record.update(_loader_step(loader, moe_utils, model_class, model_config.hf_config, quant_config))
        except Exception as e:  # noqa: BLE001 - what stopped this runner's start
            record["stopped"] = f"{type(e).__name__}: {e}"
        out.append(record)
    return out


def _loader_step(loader, moe_utils, model_class, hf_config, quant_config) -> dict:
    """Call the loader's shared-experts step as the loader does; what SGLang's model then builds."""
    import types

    if hasattr(loader, "resolve_shared_experts_config"):
        got = loader.resolve_shared_experts_config(model_class, hf_config, quant_config)
        return dict(fusion_disabled=got.fusion_disabled, num_fused_shared_experts=got.num_fused_shared_experts,
                    type=f"{type(got).__module__}.{type(got).__name__}", step="resolve_shared_experts_config")
    loader.install_shared_experts_fusion_decision(model_class, hf_config, quant_config)
    disabled = bool(moe_utils.is_shared_experts_fusion_disabled())
    stand_in = types.SimpleNamespace(config=hf_config, num_fused_shared_experts=0)
    count = getattr(model_class, "determine_num_fused_shared_experts", None)
    if count is not None:       # the model's own count, from the flag the step installed
        count(stand_in)
    return dict(fusion_disabled=disabled, num_fused_shared_experts=int(stand_in.num_fused_shared_experts or 0),
                type="flags", step="install_shared_experts_fusion_decision")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda:9.0")
    parser.add_argument("--run", action="append", required=True, metavar="SCENARIO:DEPLOYMENT[@REGISTRY]")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging

    logging.getLogger().setLevel(logging.ERROR)
    plan_log = logging.getLogger("loadplan.integrations.sglang")   # the plan ids, on stderr
    plan_log.setLevel(logging.INFO)
    plan_log.addHandler(logging.StreamHandler(sys.stderr))
    plan_log.propagate = False
    sglang_cpu.emulate(args.device)
    for spec in args.run:
        scenario, _, rest = spec.partition(":")
        deployment, _, registry = rest.partition("@")
        if scenario not in SCENARIOS:
            parser.error(f"--run: unknown scenario {scenario!r}; known: {', '.join(sorted(SCENARIOS))}")
        for record in run(scenario, registry or None, deployment):
            print("RUNNER " + json.dumps(record, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
