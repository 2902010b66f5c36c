"""An observed plan: what an engine release without a profile decided, recorded with the runner's inputs.

A fleet upgrades before the registry has a profile of the new release; such a runner must still start. Its adapter
lets the engine decide, then sends the request with what the engine decided (`observed`: its shared-experts
fusion, as far as the adapter can read it). The registry records a plan of the request's own release, made of:
- the observed decisions, as the engine decided them (rule `observed.<engine>`);
- every other decision as the nearest profiled release decides it (the newest not newer than the observed one,
  else the oldest), said so in its reason;
- `engine.profile` "<engine> <release> (observed)".
The hazards the registry knows still stop the start: the nearest profile's hazards for these inputs (with the
observed fusion), and a fused shared slot observed on a dispatch path without per-rank slots. The plan goes through
the same store, pins and rank agreement as a resolved one; the observed values are deployment-wide inputs too, so
ranks that observed different decisions are refused naming the key.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Mapping

from loadplan.errors import FailedPrecondition, InvalidArgument, NotFound, RegistryError
from loadplan.plan import Decision, Keys, ResolveRequest

from . import hazards, sglang
from .engines import ENGINES, Engine
from .resolve import LAYOUT, Resolution, layout_of, resolve_decisions

HAZARD_PREFIX = "hazard:"
# What an adapter can observe of an engine's decision (the keys it may send), each with the values it may take.
# SGLang's adapter reads the fusion; vLLM's plugin also the forward path and the reduction after the experts
# (FusedMoEParallelConfig and the prepare/finalize's output_is_reduced(), asked in the worker).
OBSERVABLE: dict[str, tuple[str, object]] = {
    Keys.SHARED_EXPERTS_FUSION: ("a bool", lambda v: isinstance(v, bool)),
    Keys.NUM_FUSED_SHARED_EXPERTS: ("an int >= 0", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    Keys.FORWARD_PATH: ("'normal' or 'a2a'", lambda v: v in ("normal", "a2a")),
    Keys.POST_EXPERTS_ALL_REDUCE: ("a bool", lambda v: isinstance(v, bool)),
}


def _version_key(version: str) -> tuple:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in version.replace("-", ".").split("."))


def nearest_release(engine: Engine, version: str) -> str:
    """The profiled release whose decisions stand for an unprofiled `version`'s: the newest not newer, else the
    oldest."""
    older = [r for r in engine.releases if _version_key(r) <= _version_key(version)]
    return max(older, key=_version_key) if older else min(engine.releases, key=_version_key)


def observed_decisions(req: ResolveRequest, observed: Mapping[str, Decision]) -> Resolution:
    rt = req.runtime
    if rt.engine not in ENGINES:
        raise NotFound("runtime.engine", rt.engine[:64], ENGINES, field="runtime.engine")
    engine = ENGINES[rt.engine]
    if not rt.engine_version:
        raise InvalidArgument("runtime.engine_version", "required: the release that decided")
    if rt.engine_version in engine.releases:
        raise FailedPrecondition(f"runtime.engine_version: {engine.name} {rt.engine_version} has a profile: its "
                                 f"runners ask ResolveLoadPlan", field="runtime.engine_version")
    unknown = sorted(set(observed) - set(OBSERVABLE))
    if unknown:
        raise InvalidArgument("decisions", f"{unknown[0]!r} is not an observable decision; observable: "
                                           f"{', '.join(OBSERVABLE)}")
    for key, d in observed.items():
        want, ok = OBSERVABLE[key]
        if not ok(d.value):
            raise InvalidArgument(f"decisions[{key}].value", f"{d.value!r}: must be {want}")
    nearest = nearest_release(engine, rt.engine_version)
    fused = observed.get(Keys.SHARED_EXPERTS_FUSION)
    # The nearest profile, asked with the fusion the engine chose where it chose none.
    basis_rt = replace(rt, engine_version=nearest,
                       disable_shared_experts_fusion=rt.disable_shared_experts_fusion or (
                           fused is not None and fused.value is False))
    try:
        basis = resolve_decisions(replace(req, runtime=basis_rt))
    except RegistryError as e:
        if e.message.startswith(HAZARD_PREFIX):
            raise type(e)(f"{e.message} (as {engine.name} {nearest}, the nearest profiled release, decides "
                          f"{engine.name} {rt.engine_version}'s inputs)", field=e.field) from None
        raise
    decisions = {k: replace(d, reason=f"as {engine.name} {nearest}'s profile decides (no profile of "
                                      f"{rt.engine_version}): {d.reason}")
                 for k, d in basis.decisions.items()}
    for key, d in observed.items():
        decisions[key] = Decision(key, d.value, d.reason or f"{engine.name} {rt.engine_version} decided it",
                                  f"observed.{engine.name}", True)
    decisions[Keys.ENGINE_PROFILE] = Decision(
        Keys.ENGINE_PROFILE, f"{engine.name} {rt.engine_version} (observed)",
        f"{engine.name} {rt.engine_version} has no profile: the engine decided, the registry recorded it; what the "
        f"engine did not report is as {engine.name} {nearest} decides", f"observed.{engine.name}")
    if rt.engine == sglang.NAME and fused is not None and fused.value and \
            decisions[Keys.FORWARD_PATH].value == "a2a" and rt.a2a_backend not in sglang.PER_RANK_FUSED_SLOTS:
        raise hazards.refuse("sglang.fused_global_slot_on_dispatch",
                             f"{basis.entry_class} observed fusing its shared expert with --moe-a2a-backend "
                             f"{rt.a2a_backend}")
    inputs = {**basis.deployment_inputs, "runtime.engine_version": rt.engine_version,
              "runtime.disable_shared_experts_fusion": rt.disable_shared_experts_fusion,
              **{f"observed.{k}": d.value for k, d in observed.items()}, LAYOUT: layout_of(decisions)}
    return Resolution(basis.entry_class, basis.chain, basis.family, basis.config_fingerprint, basis.quantization,
                      MappingProxyType(decisions), MappingProxyType(inputs), req)
