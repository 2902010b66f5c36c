"""Capability tables per engine and release: the a2a backends the engine has, as it spells them (ListBackends).

- loadplan: this project's own table (backends.py), what its torch engine plans on.
- sglang: the release's `--moe-a2a-backend` values (layers/moe/utils.py: MoeA2ABackend, every member), with what
  the profile knows of each: whether its experts layer dispatches and combines (fused_moe_triton/layer.py:
  create_moe_dispatcher) or its combine returns complete outputs (post_experts_output_is_complete), whether it is
  DeepEP-class, holds a fused shared slot per rank, or forces fusion off. `customized` (a dispatcher a user
  registers) is listed and not accepted: the registry cannot know what it builds.
- vllm: the release's `--all2all-backend` values (config/parallel.py: All2AllBackend, every member), with whether
  its prepare/finalize's combine is reduced (output_is_reduced). `pplx`, which vLLM names and builds no
  prepare/finalize for, is listed and not accepted.
A model's forward path still depends on its MoE block (SGLang) and on the layout (vLLM runs the all2all kernels only
with expert parallelism and DP > 1): `forward_path` is the backend's own, the plan says what a model takes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loadplan.errors import RegistryError
from loadplan.plan import ENGINE_LOADPLAN, ENGINE_SGLANG, ENGINE_VLLM, Keys
from . import sglang, vllm
from .backends import A2A, BACKENDS, NORMAL
from .devices import parse_device
from .engines import engine_by_name, engine_of, with_engine
from .resolve import validate_request
from .sglang_releases import release as sglang_release


@dataclass(frozen=True)
class BackendRow:
    name: str
    forward_path: str            # NORMAL or A2A: the backend's own (a model's may differ, see the module's doc)
    combine_reduces: bool        # the combine returns each token's complete output
    deepep_class: bool
    per_rank_fused_slots: bool
    fusion_force_disabled: bool
    accepted: bool = True        # the registry plans on it for this engine and release
    note: str = ""


SGLANG_NOT_PLANNED = {"customized": "a dispatcher the user registers (MoeA2ABackend.CUSTOMIZED): what it builds is "
                                    "not SGLang's code, so the registry cannot answer for it"}
VLLM_NOT_PLANNED = {"pplx": "vLLM's All2AllBackend names it, but maybe_make_prepare_finalize builds nothing for it"}
VLLM_LITERAL_ORDER = ("naive", "pplx", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
                      "mori_high_throughput", "mori_low_latency", "moonep", "nixl_ep", "allgather_reducescatter",
                      "flashinfer_all2allv", "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided",
                      "passthrough")


def backends_of(engine: str = "", version: str = "") -> tuple[str, str, list[BackendRow]]:
    """(engine, release, its backend table); engine "" is loadplan, version "" the engine's newest. NOT_FOUND for an
    engine or release the registry has no profile of."""
    row = engine_by_name(engine or ENGINE_LOADPLAN, version)
    version = version or row.version
    if row.name == ENGINE_SGLANG:
        return row.name, version, _sglang(version)
    if row.name == ENGINE_VLLM:
        return row.name, version, _vllm(version)
    return row.name, version, [BackendRow(b.name, b.forward_path, b.combine_reduces, b.deepep_class,
                                          b.per_rank_fused_slots, b.fusion_force_disabled) for b in BACKENDS.values()]


def _sglang(version: str) -> list[BackendRow]:
    release = sglang_release(version)
    rows = []
    # MoeA2ABackend's members: the release's accepted ones, then those the profile does not plan on
    for name in (*release.a2a_backends, *SGLANG_NOT_PLANNED):
        blocks = sorted(b for b, names in release.dispatch_branch.items() if name in names)
        dispatches = name in sglang.A2A_DISPATCHER or name in sglang.COMPLETE_COMBINE or bool(blocks)
        note = SGLANG_NOT_PLANNED.get(name) or (f"the dispatch branch of the {', '.join(blocks)} MoE blocks"
                                                if blocks else "")
        rows.append(BackendRow(
            name, A2A if dispatches else NORMAL, combine_reduces=dispatches, deepep_class=name in sglang.DEEPEP_CLASS,
            per_rank_fused_slots=name in sglang.PER_RANK_FUSED_SLOTS,
            fusion_force_disabled=name in sglang.A2A_FORCES_FUSION_OFF, accepted=name not in SGLANG_NOT_PLANNED,
            note=note))
    return rows


def _vllm(version: str) -> list[BackendRow]:
    accepted = vllm.RELEASES[version]
    rows = []
    for name in VLLM_LITERAL_ORDER:
        if name not in accepted and name not in VLLM_NOT_PLANNED:
            continue        # not in this release (passthrough before 0.32.0)
        r = vllm.ALL2ALL.get(name)
        kernels = r is not None and name not in (vllm.DEFAULT_ALL2ALL, "naive")
        rows.append(BackendRow(
            name, A2A if kernels else NORMAL, combine_reduces=bool(r and r.output_is_reduced), deepep_class=False,
            per_rank_fused_slots=False, fusion_force_disabled=False, accepted=name in accepted,
            note=VLLM_NOT_PLANNED.get(name, "" if r is None else
                                      r.source + ("" if r.always_dispatches or not kernels else
                                                  "; its kernels run only with expert parallelism and DP > 1"))))
    return rows



@dataclass(frozen=True)
class Candidate:
    """One backend or MoE runner a runner could start with: whether the engine would, and why."""
    name: str
    starts: bool
    reason: str                  # the refusal (the engine's words, or the hazard), or what the plan would say
    forward_path: str = ""       # where it starts: the plan's forward path and fusion
    shared_experts_fusion: bool = False


@dataclass(frozen=True)
class StartReport:
    engine: str
    engine_version: str
    backends: tuple[Candidate, ...]
    moe_runners: tuple[Candidate, ...]     # SGLang's --moe-runner-backend values (the other engines have none)


def starts_with(req, decide) -> StartReport:
    """For `req`'s config and runtime, every a2a backend of its engine (and, for SGLang, every MoE runner) tried in
    its place: the plan `decide` (the rules' resolve, nothing stored) makes, or its refusal. The request's own
    checks (config, ranks, engine and release) fail as a resolve would."""
    validate_request(req)
    req = with_engine(req, engine_of(req, parse_device(req.runtime.device)))   # the engine and release that decide
    engine, version = req.runtime.engine, req.runtime.engine_version

    def attempt(name: str, runtime) -> Candidate:
        try:
            d = decide(replace(req, runtime=runtime)).decisions
        except RegistryError as e:
            return Candidate(name, False, e.message)
        path, fused = d[Keys.FORWARD_PATH], d[Keys.SHARED_EXPERTS_FUSION]
        return Candidate(name, True, f"{path.reason}; fusion: {fused.reason}", path.value, bool(fused.value))

    _, _, rows = backends_of(engine, version)
    backends = tuple(attempt(r.name, replace(req.runtime, a2a_backend=r.name)) for r in rows if r.accepted)
    runners = ()
    if engine == ENGINE_SGLANG:
        runners = tuple(attempt(name, replace(req.runtime, moe_runner_backend=name))
                        for name in sglang_release(version).moe_runner_backends)
    return StartReport(engine, version, backends, runners)
