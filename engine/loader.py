"""`load_model`: the engine's single instantiation point (DESIGN 3, issue 3).

1. read config.json (and its quantization: unquantized, or a format read dequantized:
   block-quantized fp8, engine/fp8.py; compressed-tensors' packed integers,
   engine/compressed_tensors.py; MXFP4, engine/mxfp4.py; GPTQ and AWQ, engine/gptq.py,
   engine/awq.py);
2. ask the registry for this runner's plan;
3. build the model on `meta` with the (guarded) plan passed to its constructor;
4. load the weights by the plan (engine/weights.py) and assign them, or assign a
   pre-built state dict from a shared-memory weight cache (engine/weight_cache.py),
   which bypasses the checkpoint remapping entirely;
5. the EPLB descriptor `routed_experts_weights_of_layer` was attached at
   construction and resolves lazily, so both paths have it.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import socket
import uuid
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from loadplan.plan import ENGINE_LOADPLAN, LoadPlan, Parallel, ResolveRequest, Runtime
from .checkpoint import Checkpoint, read_config
from .plan_guard import GuardedPlan
from .registry import ENGINE_ENTRY_CLASSES, engine_chain, model_class
from .weights import assign_state_dict, build_state_dict

log = logging.getLogger(__name__)

# The torch runner computes in plain dtypes: a quantized checkpoint of these formats is dequantized as it is read.
# The plan's quantization name -> the module that checks the config (`scheme`, before any plan) and shows the
# checkpoint as the plain tensors it stands for (`dequantized(ckpt, scheme)`). Other quantizations are refused.
DEQUANTIZED_FORMATS = {
    "fp8": "loadplan.engine.fp8",                                   # block-quantized (DeepSeek-V3/R1)
    "compressed_tensors": "loadplan.engine.compressed_tensors",     # pack-quantized integers (Kimi-K2.5)
    "mxfp4": "loadplan.engine.mxfp4",                               # microscaled FP4 experts (gpt-oss)
    "gptq": "loadplan.engine.gptq",                                 # GPTQ's packed integers (AutoGPTQ, GPTQModel)
    "awq": "loadplan.engine.awq",                                   # AWQ's packed 4-bit integers (AutoAWQ gemm)
}
SUPPORTED_QUANTIZATIONS = (None, *DEQUANTIZED_FORMATS)


def checkpoint_format(quantization_config: Any) -> tuple[str | None, Any, Any]:
    """(format name, its module, the checked scheme) of a checkpoint's quantization_config; (None, None,
    None) when it names no format the engine reads (unquantized, or refused once the plan names it).
    A config the format's module cannot read is refused here, by field, before any plan."""
    q = quantization_config if isinstance(quantization_config, dict) else {}
    name = str(q.get("quant_method") or "").strip().lower().replace("-", "_")
    if name not in DEQUANTIZED_FORMATS:
        return None, None, None
    module = importlib.import_module(DEQUANTIZED_FORMATS[name])
    return name, module, module.scheme(q)


class PlanResolver(Protocol):
    def resolve_load_plan(self, request: ResolveRequest) -> LoadPlan: ...


def registry_device(device: str | torch.device) -> str:
    """The registry's device spelling (`cpu`, `cuda:9.0`, `hip:9.4`) of a torch device."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        return f"{'hip' if torch.version.hip else 'cuda'}:{major}.{minor}"
    raise ValueError(f"device {device!r} not supported; supported: cpu, cuda")


def resolve_plan(request: ResolveRequest, registry: PlanResolver | str) -> LoadPlan:
    """`registry`: a registry's address, or an object with resolve_load_plan(request) (a RegistryClient, a test's
    fake). The engine starts no registry: what runs one beside a worker (`loadplan generate` without --registry,
    the demo) lives above both."""
    if not isinstance(registry, str):
        return registry.resolve_load_plan(request)
    from loadplan.client import RegistryClient

    with RegistryClient(registry) as client:
        return client.resolve_load_plan(request)


def build_model(hf_config: dict, plan: GuardedPlan, dtype: torch.dtype) -> nn.Module:
    """Construct the plan's entry class on `meta` (no memory, no init)."""
    entry = plan.entry_class
    declared = _declared_entry(hf_config)
    if entry != declared:
        raise ValueError(f"plan {plan.plan_id} is for {entry!r} but config.json declares {declared!r}")
    engine_chain(entry)  # refuses an entry class the engine cannot build, listing the supported ones
    cls = model_class(entry)
    with torch.device("meta"):
        return cls(hf_config, plan, dtype=dtype)


def load_weights(model: nn.Module, ckpt: Checkpoint, device: str | torch.device) -> None:
    view = getattr(model, "checkpoint_view", None)     # a family's own arrangement of its tensors (gpt-oss)
    if view is not None:
        ckpt = view(ckpt)
    layout = model.weight_layout()
    expected = model.state_dict()
    state, report = build_state_dict(ckpt.names(), ckpt.get, ckpt.shape, expected, layout, device=device,
                                     source_name=getattr(ckpt, "source_name", None))
    assign_state_dict(model, state)
    log.info("loaded %d tensors (%d held by other ranks)", report.loaded, report.skipped_other_ranks)


def _declared_entry(hf_config: dict) -> str | None:
    """The entry class config.json declares (architectures[0])."""
    return (hf_config.get("architectures") or [None])[0]


def _declared_class_says(hf_config: dict, attribute: str) -> bool:
    """Does the engine class of the declared entry class set `attribute`? False when the engine does not
    build that class (it is refused, by name, when the plan's entry class is built)."""
    entry = _declared_entry(hf_config)
    return entry in ENGINE_ENTRY_CLASSES and bool(getattr(model_class(entry), attribute, False))


def _check_runner_role(hf_config: dict, role: str) -> None:
    """A draft that predicts from a target's hidden states (a NextN / MTP layer) cannot be the target: refused
    before its plan is resolved, so no plan is recorded for a runner that cannot run."""
    if role != "speculative" and _declared_class_says(hf_config, "drafts_from_target_hidden"):
        entry = _declared_entry(hf_config)
        raise ValueError(f"{entry} is a speculative draft (it predicts from a target's hidden states), not a "
                         f"{role} runner: load it with role speculative, e.g. `loadplan generate --model TARGET "
                         f"--draft DIR`")


def _check_config(hf_config: dict) -> None:
    """Before any plan: config.json read as the declared entry class's family reads it, so a field the family
    cannot run is refused by name with no plan recorded (an entry class the engine does not build is left to
    the registry, which lists the known ones, and then to `build_model`)."""
    entry = _declared_entry(hf_config)
    if entry in ENGINE_ENTRY_CLASSES:
        model_class(entry).parse_config(hf_config)


def _check_tensor_parallel(hf_config: dict, tp_size: int) -> None:
    """Before any plan: only the families whose layers split themselves run with tp_size > 1."""
    entry = _declared_entry(hf_config)
    if entry in ENGINE_ENTRY_CLASSES and not _declared_class_says(hf_config, "TENSOR_PARALLEL"):
        capable = sorted(e for e in ENGINE_ENTRY_CLASSES if getattr(model_class(e), "TENSOR_PARALLEL", False))
        raise NotImplementedError(f"tensor parallelism (tp_size={tp_size}) is not implemented by the engine for "
                                  f"{entry}; it is for: {', '.join(capable)} (or run expert and pipeline "
                                  f"parallelism: ep_size, pp_size)")


def _loadplan_runtime(runtime: Runtime, device: str | torch.device) -> Runtime:
    """`runtime` on this engine and device: the loader says both (a runtime that names others is refused)."""
    spelled = registry_device(device)
    if runtime.engine not in ("", ENGINE_LOADPLAN):
        raise ValueError(f"runtime.engine {runtime.engine!r}: this is loadplan's engine ({ENGINE_LOADPLAN!r})")
    if runtime.device not in (Runtime.device, spelled):
        raise ValueError(f"runtime.device {runtime.device!r} differs from the device it is loaded on ({spelled!r})")
    return dataclasses.replace(runtime, device=spelled, engine=ENGINE_LOADPLAN)


def load_model(path: str | Path, parallel: Parallel = Parallel(), runtime: Runtime = Runtime(), *,
               registry: PlanResolver | str, role: str = "target", deployment: str | None = None,
               request_id: str | None = None, quantization: str | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, weight_cache: str | Path | None = None) -> nn.Module:
    """Build the model of checkpoint folder `path` for this runner, as the registry's plan says.

    `parallel` and `runtime` are what the runner asks the registry with (the contract's types); the runtime's
    `device` and `engine` are the loader's to say: the registry's spelling of `device`, and loadplan's engine.
    `deployment` None: a fresh deployment of its own. Returns a module: `model(input_ids [B, T]) -> logits
    [B, T, V]`, with `model.plan` the guarded plan and `model.routed_experts_weights_of_layer` the EPLB
    descriptor. `weight_cache`: a file (put it under /dev/shm) holding this runner's state dict; if it exists
    it is assigned instead of reading the checkpoint, else it is written.
    """
    hf_config = read_config(path)
    qconfig = hf_config.get("quantization_config")
    _check_runner_role(hf_config, role)
    _check_config(hf_config)
    fmt, fmt_module, fmt_scheme = checkpoint_format(qconfig)     # refused by field before any plan is resolved
    if parallel.tp_size != 1:
        _check_tensor_parallel(hf_config, parallel.tp_size)
    request = ResolveRequest(
        request_id=request_id or uuid.uuid4().hex,
        deployment_id=deployment or uuid.uuid4().hex,
        role=role,
        parallel=parallel,
        host=socket.gethostname()[:255],
        config=hf_config,
        quantization_config=qconfig if isinstance(qconfig, dict) else None,
        quantization=quantization,
        runtime=_loadplan_runtime(runtime, device),
    )
    plan = GuardedPlan(resolve_plan(request, registry))
    if plan.quantization not in SUPPORTED_QUANTIZATIONS:
        raise NotImplementedError(f"quantization {plan.quantization!r} not supported by the engine; supported: none "
                                  f"(unquantized checkpoints), {', '.join(DEQUANTIZED_FORMATS)} (quantized "
                                  f"checkpoints, dequantized at load)")
    if plan.quantization != fmt:
        raise NotImplementedError(f"quantization {plan.quantization!r} for a checkpoint whose quantization_config is "
                                  f"{qconfig!r}: the engine does not quantize online; it reads "
                                  f"{plan.quantization} weights only from a checkpoint quantized with them")
    model = build_model(hf_config, plan, dtype)
    if weight_cache is not None and Path(weight_cache).exists():
        from .weight_cache import load_weight_cache

        load_weight_cache(model, weight_cache, device=device)
    else:
        ckpt = Checkpoint(path)
        load_weights(model, ckpt if fmt is None else fmt_module.dequantized(ckpt, fmt_scheme), device)
        if weight_cache is not None:
            from .weight_cache import save_weight_cache

            save_weight_cache(model, weight_cache)
    return model


__all__ = ["load_model", "resolve_plan", "build_model", "load_weights"]
