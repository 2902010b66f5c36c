"""The load-plan vocabulary shared by client, service and engine.

Pure dataclasses, no grpc, sqlalchemy or torch: the rules build these, the
store persists them, the transport translates them, the engine reads them.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

ROLE_TARGET = "target"
ROLE_SPECULATIVE = "speculative"
ROLES = (ROLE_TARGET, ROLE_SPECULATIVE)

# The engines the registry answers for (`runtime.engine`); service/rules/engines.py holds their rows.
ENGINE_LOADPLAN = "loadplan"
ENGINE_SGLANG = "sglang"
ENGINE_VLLM = "vllm"


class Keys:
    """Decision keys (DESIGN section 4). Model code reads these, never backend names."""

    ENGINE_PROFILE = "engine.profile"
    ENGINE_INPUTS_NOT_READ = "engine.inputs_not_read"   # the engine inputs sent that the profile does not read
    ENTRY_FAMILY = "model.family"
    SHARED_EXPERTS_FUSION = "moe.shared_experts_fusion"
    NUM_FUSED_SHARED_EXPERTS = "moe.num_fused_shared_experts"
    FUSED_SHARED_EXPERT_SCALE = "moe.fused_shared_expert_scale"
    FUSED_SHARED_SLOT_PLACEMENT = "moe.fused_shared_slot_placement"
    FORWARD_PATH = "moe.forward_path"
    POST_EXPERTS_ALL_REDUCE = "moe.post_experts_all_reduce"
    NUM_LOCAL_EXPERTS = "moe.num_local_routed_experts"
    PP_LAYER_RANGE = "pp.layer_range"
    EPLB_ENABLED = "eplb.enabled"
    EPLB_NUM_PHYSICAL_EXPERTS = "eplb.num_physical_experts"
    EPLB_LAYERS = "eplb.layers"
    EPLB_PLACEMENT = "eplb.placement"


@dataclass(frozen=True)
class Parallel:
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0


@dataclass(frozen=True)
class Runtime:
    a2a_backend: str = "none"
    device: str = "cpu"
    # "" (unset): the registry picks by device (loadplan on cpu, sglang on cuda/hip/musa); a stored
    # or answered plan carries the engine and version that decided.
    engine: str = ""
    engine_version: str = ""
    moe_runner_backend: str = ""    # SGLang's --moe-runner-backend, as SGLang spells it; "" is "auto"
    enable_sbo: bool = False
    enable_tbo: bool = False
    disable_shared_experts_fusion: bool = False
    enforce_shared_experts_fusion: bool = False
    enable_eplb: bool = False
    ep_num_redundant_experts: int = 0
    # The engine's own inputs, as the engine spells them: its server arguments (SGLang's ServerArgs fields, vLLM's
    # config fields) and the environment switches its decision reads (SGLANG_*, VLLM_*). Held as (name, value)
    # pairs sorted by name, so that a Runtime stays hashable; a mapping is accepted. Each profile declares the names
    # it reads (service/rules/engine_inputs.py); the others are kept and listed in the plan as not read.
    engine_args: tuple[tuple[str, str], ...] = ()
    engine_env: tuple[tuple[str, str], ...] = ()
    # The release this runner's deployment is being upgraded from, named by the operator: runners of both releases
    # may then share the deployment while every deployment-wide decision agrees ("" none: releases must not mix).
    upgrade_from: str = ""

    def __post_init__(self):
        for name in ("engine_args", "engine_env"):
            object.__setattr__(self, name, _pairs(getattr(self, name)))

    def arg(self, name: str) -> str | None:
        return dict(self.engine_args).get(name)

    def env(self, name: str) -> str | None:
        return dict(self.engine_env).get(name)


def _pairs(value: Any) -> tuple[tuple[str, str], ...]:
    """(name, value) pairs sorted by name from a mapping or pairs; values kept as given (the rules check them)."""
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((k, v) for k, v in ((tuple(p) if isinstance(p, list) else p) for p in items)))


@dataclass(frozen=True)
class ResolveRequest:
    """What one runner asks at its instantiation point."""

    request_id: str
    deployment_id: str
    role: str = ROLE_TARGET
    parallel: Parallel = field(default_factory=Parallel)
    host: str = ""
    config: Mapping[str, Any] = field(default_factory=dict)
    quantization_config: Mapping[str, Any] | None = None
    quantization: str | None = None  # explicit name; overrides quantization_config
    runtime: Runtime = field(default_factory=Runtime)


@dataclass(frozen=True)
class Decision:
    key: str
    value: Any
    reason: str
    rule: str
    deployment_wide: bool = True
    revision: int = 0
    # None in a plan: decided when the plan was created (its created_at). A new plan's
    # resolved decisions come so from the rules; what is read back or received is stamped.
    decided_at: dt.datetime | None = None


@dataclass(frozen=True)
class LoadPlan:
    """A resolved plan: the decisions of one runner and what they were made from."""

    plan_id: str
    ruleset_version: str
    request: ResolveRequest
    entry_class: str
    config_fingerprint: str
    quantization: str | None
    decisions: Mapping[str, Decision]
    created_at: dt.datetime | None = None
    replayed: bool = False
    history: tuple[Decision, ...] = ()

    def value(self, key: str) -> Any:
        return self.decisions[key].value

    @property
    def observed(self) -> bool:
        """An observed plan: the engine release had no profile, the engine decided and the registry recorded it
        (service/rules/observed.py); its `engine.profile` says so."""
        profile = self.decisions.get(Keys.ENGINE_PROFILE)
        return profile is not None and profile.rule.startswith("observed.")

    def dated(self) -> "LoadPlan":
        """This plan with a time on every decision: those without one (a new plan's, as the
        registry decided them) were decided at its created_at. A stored or received plan is so."""
        if all(d.decided_at is not None for d in self.decisions.values()):
            return self
        return replace(self, decisions={k: d if d.decided_at is not None else replace(d, decided_at=self.created_at)
                                        for k, d in self.decisions.items()})

    def to_json(self) -> dict[str, Any]:
        """The `--json` shape of the CLI: plan id, ruleset version, decisions."""
        return {
            "plan_id": self.plan_id,
            "ruleset_version": self.ruleset_version,
            "deployment_id": self.request.deployment_id,
            "role": self.request.role,
            "entry_class": self.entry_class,
            "replayed": self.replayed,
            "decisions": {
                k: {"value": d.value, "reason": d.reason, "rule": d.rule}
                for k, d in sorted(self.decisions.items())
            },
        }


@dataclass(frozen=True)
class PlanDiff:
    """Two plans and what differs between them (the audit's target-vs-draft view)."""

    a: LoadPlan
    b: LoadPlan
    decisions: list[tuple[str, Decision | None, Decision | None]]   # key, in a, in b
    inputs: list[tuple[str, Any, Any]]                              # field, a, b
