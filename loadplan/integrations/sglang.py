"""SGLang workers ask the registry: an adapter at SGLang's single instantiation point.

SGLang's loader asks its shared-experts step once per runner, just before it constructs the
model (a draft's inside `draft_model_build_scope()`): `resolve_shared_experts_config(model_class,
hf_config, quant_config)` from 0.5.23, `install_shared_experts_fusion_decision(...)` in 0.5.18 to
0.5.22 (which installs the decision in SGLang's flags). With the adapter installed that step asks
the registry (`ResolveLoadPlan`, engine `sglang`, the installed release) instead, with the runner's
identity read from SGLang's own published state, and hands the registry's decision back to SGLang
as that step would (SGLang's `SharedExpertsConfig`, or its flags). The plan id is logged. A
refused plan (a hazard, ranks that disagree) stops that runner's start with the registry's
message; an unreachable registry is retried as the client retries, then stops the start too.
Only `allow_fallback=True` lets SGLang decide on its own then, and it says so loudly.

A release the registry has no profile of never blocks a start: the registry answers NOT_FOUND
for its `runtime.engine_version`, SGLang's own step decides, and the adapter records what it
decided (`RecordObservedPlan`): an observed plan, with the same history, pins and rank
agreement, and still refused where the registry knows the layout for a hazard.

    from loadplan.integrations import sglang
    sglang.install(registry="registry:50051", deployment="dsv3-prod")   # before SGLang loads

`loadplan sglang-run -- python -m sglang.launch_server ...` installs it in every Python
process the command starts (SGLang spawns one scheduler per rank), through the start-up
hook in `sglang_boot/` and the LOADPLAN_SGLANG_* environment variables below.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import json
import logging
import os
import socket
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from ..plan import ENGINE_SGLANG, ROLE_SPECULATIVE, ROLE_TARGET, Keys, LoadPlan, Parallel, ResolveRequest, Runtime

log = logging.getLogger("loadplan.integrations.sglang")

# The loader's shared-experts step, by its name in SGLang (newest first), and the oldest release that has one:
# the adapter hooks whichever the installed SGLang has.
STEPS = ("resolve_shared_experts_config", "install_shared_experts_fusion_decision")
OLDEST = (0, 5, 18)

# What `loadplan sglang-run` passes to the processes it starts.
ENV_ACTIVE = "LOADPLAN_SGLANG"             # "1": the start-up hook installs the adapter
ENV_REGISTRY = "LOADPLAN_SGLANG_REGISTRY"  # registry address (host:port)
ENV_DEPLOYMENT = "LOADPLAN_SGLANG_DEPLOYMENT"
ENV_ALLOW_FALLBACK = "LOADPLAN_SGLANG_ALLOW_FALLBACK"
ENV_TIMEOUT = "LOADPLAN_SGLANG_TIMEOUT"
# An upgrade the operator names on the upgraded replicas: the release the deployment's other runners run
ENV_UPGRADE_FROM = "LOADPLAN_SGLANG_UPGRADE_FROM"
# The token travels as the client's own LOADPLAN_TOKEN / LOADPLAN_TOKEN_FILE.

# The modules that hold SGLang's function: its definition, and the loader, which
# imported it by name.
MOE_UTILS = "sglang.srt.layers.moe.utils"
LOADER = "sglang.srt.model_loader.loader"


class SglangVersionError(RuntimeError):
    pass


class LoadPlanRefused(RuntimeError):
    """The registry refused this runner's plan (or could not be reached): the start stops."""


@dataclass(frozen=True)
class Options:
    registry: str
    deployment: str | None = None
    token: str | None = None
    timeout: float = 30.0
    allow_fallback: bool = False


_lock = threading.Lock()
_options: Options | None = None
_client = None
_originals: dict[str, Any] = {}     # step name -> SGLang's own function


def sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    numbers = []
    for part in version.split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def check_version(version: str | None = None) -> str:
    """The installed SGLang version, refused only where the loader has no shared-experts step to hook (before
    0.5.18). Any later release starts: profiled ones ask the registry, others are observed."""
    version = version if version is not None else sglang_version()
    if version is None:
        raise SglangVersionError("loadplan's SGLang adapter: sglang is not installed in this Python "
                                 f"({sys.executable})")
    if _release(version) < OLDEST:
        raise SglangVersionError(
            f"loadplan's SGLang adapter hooks the loader's shared-experts step ({' or '.join(STEPS)}), which SGLang "
            f"has from {'.'.join(map(str, OLDEST))}; this is sglang {version}. Run a newer release, or start SGLang "
            f"without the adapter")
    return version


def install(registry: str | None = None, *, deployment: str | None = None, token: str | None = None,
            timeout: float | None = None, allow_fallback: bool | None = None) -> None:
    """Make this process's SGLang ask the registry at its instantiation point.

    Call before SGLang builds a model: the function is replaced in SGLang's modules now
    if they are imported, else as soon as they are. Unset arguments come from the
    LOADPLAN_SGLANG_* environment. Raises SglangVersionError for an SGLang it does not know.
    """
    global _options, _client
    check_version()
    env = os.environ
    registry = registry or env.get(ENV_REGISTRY)
    if not registry:
        raise ValueError(f"registry: an address is needed (install(registry=...) or ${ENV_REGISTRY})")
    options = Options(
        registry=registry,
        deployment=deployment or env.get(ENV_DEPLOYMENT) or None,
        token=token,
        timeout=float(timeout if timeout is not None else env.get(ENV_TIMEOUT, 30.0)),
        allow_fallback=bool(allow_fallback if allow_fallback is not None
                            else env.get(ENV_ALLOW_FALLBACK, "") in ("1", "true", "yes")),
    )
    with _lock:
        if _client is not None:
            _client.close()
        _options, _client = options, None
        if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())
        for name in (MOE_UTILS, LOADER):
            if name in sys.modules:
                _patch(sys.modules[name])
    log.info("loadplan: SGLang %s asks the registry at %s for its load plans", sglang_version(), registry)


def installed() -> bool:
    """Whether SGLang's loader, as imported in this process, asks the registry."""
    loader = sys.modules.get(LOADER)
    utils = sys.modules.get(MOE_UTILS)
    fns = [getattr(m, step) for m in (loader, utils) if m is not None for step in STEPS if hasattr(m, step)]
    return _options is not None and bool(fns) and all(getattr(f, "__loadplan__", False) for f in fns)


def uninstall() -> None:
    """Give SGLang its own function back (tests; a process that stops asking)."""
    global _options, _client
    with _lock:
        for name in (MOE_UTILS, LOADER):
            module = sys.modules.get(name)
            for step, original in _originals.items():
                if module is not None and getattr(module, step, original) is not original:
                    setattr(module, step, original)
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]
        if _client is not None:
            _client.close()
        _options, _client = None, None


def _patch(module) -> None:
    for step, answer in ((STEPS[0], resolve_shared_experts_config), (STEPS[1], install_shared_experts_fusion_decision)):
        current = getattr(module, step, None)
        if current is None or getattr(current, "__loadplan__", False):
            continue
        if module.__name__ == MOE_UTILS:
            _originals[step] = current
        elif step not in _originals:
            _originals[step] = getattr(importlib.import_module(MOE_UTILS), step)
        setattr(module, step, answer)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches SGLang's two modules right after they execute, wherever they are imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in (MOE_UTILS, LOADER):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(module)


# --- the function SGLang calls ---------------------------------------------------


def resolve_shared_experts_config(model_class, hf_config, quant_config):
    """SGLang 0.5.23's `resolve_shared_experts_config`, answered by the registry."""
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.runtime_context import get_exec

    step = STEPS[0]
    plan = _plan(step, model_class, hf_config, quant_config)
    if plan is None:        # SGLang decided on its own (allow_fallback) or a refusal raised
        return _originals[step](model_class, hf_config, quant_config)
    if isinstance(plan, _Observed):
        return plan.answer
    fused = bool(plan.value(Keys.SHARED_EXPERTS_FUSION))
    num_decision = plan.decisions.get(Keys.NUM_FUSED_SHARED_EXPERTS)
    num = int(num_decision.value) if fused and num_decision is not None and _loader_fuses(model_class) else 0
    # `use_waterfill` is SGLang's own kernel preference for fused slots; the registry
    # decides whether there are fused slots.
    return SharedExpertsConfig(fusion_disabled=not fused, num_fused_shared_experts=num,
                               use_waterfill=num > 0 and bool(get_exec().moe.enable_waterfill))


def install_shared_experts_fusion_decision(model_class, hf_config, quant_config):
    """SGLang 0.5.18-0.5.22's `install_shared_experts_fusion_decision`, answered by the registry: the decision goes
    into SGLang's flags as that step puts it (the model's layers count their fused experts from it)."""
    from sglang.srt.runtime_context import get_flags

    step = STEPS[1]
    plan = _plan(step, model_class, hf_config, quant_config)
    if plan is None:
        return _originals[step](model_class, hf_config, quant_config)
    if isinstance(plan, _Observed):
        return None
    disabled = not bool(plan.value(Keys.SHARED_EXPERTS_FUSION))
    moe = get_flags().moe
    moe.disable_shared_experts_fusion = disabled
    if moe.in_speculative_scope:
        moe.speculative_disable_shared_experts_fusion = disabled
    return None


resolve_shared_experts_config.__loadplan__ = True
install_shared_experts_fusion_decision.__loadplan__ = True


@dataclass(frozen=True)
class _Observed:
    plan: LoadPlan | None     # None: the observation could not be recorded and allow_fallback let SGLang go on
    answer: Any               # what SGLang's own step returned (handed back to its loader)


def _plan(step: str, model_class, hf_config, quant_config):
    """This runner's plan from the registry; for a release it has no profile of, SGLang's own step decides and the
    decision is recorded (an `_Observed`). None: the registry cannot be reached and allow_fallback lets SGLang
    decide. A refusal raises LoadPlanRefused."""
    from ..client.errors import NotFoundError

    options = _options
    if options is None:   # uninstalled under a caller that kept the reference
        return None
    request = runner_request(model_class, hf_config, quant_config, deployment=options.deployment)
    try:
        plan = _registry().resolve_load_plan(request)
    except NotFoundError as e:
        if e.field != "runtime.engine_version":
            _refuse_or_fall_back(request, e)
            return None
        answer = _originals[step](model_class, hf_config, quant_config)
        try:
            plan = _registry().record_observed_plan(request, _observed(request, step, answer, model_class, hf_config))
        except Exception as e:  # noqa: BLE001 - a refused observation stops the start like a refused plan
            _refuse_or_fall_back(request, e)
            return _Observed(None, answer)
        _started(plan, request, hf_config)
        return _Observed(plan, answer)
    except Exception as e:  # noqa: BLE001 - every way of not getting a plan is judged below
        _refuse_or_fall_back(request, e)
        return None
    _started(plan, request, hf_config)
    return plan


def _started(plan: LoadPlan, request: ResolveRequest, hf_config) -> None:
    log.info("loadplan plan %s for %s %s (%s, tp %d/%d ep %d/%d pp %d/%d)%s: %s",
             plan.plan_id, request.role, plan.entry_class, request.deployment_id,
             request.parallel.tp_rank, request.parallel.tp_size, request.parallel.ep_rank,
             request.parallel.ep_size, request.parallel.pp_rank, request.parallel.pp_size,
             " OBSERVED (no profile of this SGLang release: SGLang decided)" if plan.observed else "", _summary(plan))
    refusal = _stage_refusal(plan, request, hf_config)
    if refusal is not None:
        raise LoadPlanRefused(refusal)


def _observed(request: ResolveRequest, step: str, answer, model_class, hf_config) -> list:
    """What SGLang's own step decided: SharedExpertsConfig's fields (0.5.23's step), or the flag the older step
    installed and the fused experts the model class counts from it."""
    from sglang.srt.layers.moe import utils as moe_utils

    from ..plan import Decision

    version = request.runtime.engine_version
    if step == STEPS[0]:
        disabled, count = bool(answer.fusion_disabled), int(answer.num_fused_shared_experts)
    else:
        disabled = bool(moe_utils.is_shared_experts_fusion_disabled())
        text = getattr(hf_config, "text_config", None) or hf_config
        counts = hasattr(model_class, "determine_num_fused_shared_experts")
        count = int(getattr(text, "n_shared_experts", 0) or 0) if counts and not disabled else 0
    fused = not disabled and count > 0
    observed = [Decision(Keys.SHARED_EXPERTS_FUSION, fused, f"SGLang {version}'s {step} decided it "
                                                            f"(fusion_disabled={disabled})", "sglang.adapter"),
                Decision(Keys.NUM_FUSED_SHARED_EXPERTS, count if fused else 0,
                         f"the fused shared experts SGLang {version}'s model builds", "sglang.adapter")]
    return observed


def _loader_fuses(model_class) -> bool:
    """Whether SGLang's loader hands `model_class` fused slots: only a class with both hooks ("fusion requires both
    hooks"). A class without them, Qwen3-Next's, fuses inside its MoE block as it is built: its plan says so, and the
    loader's answer stays SGLang's own, no slots."""
    return all(getattr(model_class, hook, None) is not None
               for hook in ("shared_experts_fusion_disable_reason", "num_fusable_shared_experts"))


# SGLang's override of its pipeline stages (`get_pp_indices`: one layer count per stage,
# comma-separated). The registry plans SGLang's default partition; it has no input for this one.
ENV_PP_LAYER_PARTITION = "SGLANG_PP_LAYER_PARTITION"


def _stage_refusal(plan: LoadPlan, request: ResolveRequest, hf_config) -> str | None:
    """Why this runner must not start on `plan`, or None: SGLang builds the layers of a target's stage
    by its own `get_pp_indices`, which follows SGLANG_PP_LAYER_PARTITION when it is set (and the stage
    is one of several), while the plan's `pp.layer_range` is SGLang's default partition. Where the two
    differ, the plan would record layers this runner does not hold. (A draft's stage ignores the
    partition in SGLang: its pipeline group is its own.)"""
    partition = os.environ.get(ENV_PP_LAYER_PARTITION)
    planned = plan.decisions.get(Keys.PP_LAYER_RANGE)
    parallel = request.parallel
    if partition is None or request.role != ROLE_TARGET or parallel.pp_size == 1 or planned is None:
        return None
    from sglang.srt.distributed import get_pp_indices

    text = getattr(hf_config, "text_config", None) or hf_config
    n_layers = int(text.num_hidden_layers)
    try:
        built = list(get_pp_indices(n_layers, parallel.pp_rank, parallel.pp_size))
    except ValueError as e:   # SGLang's own refusal of the partition, before the registry's
        return f"{ENV_PP_LAYER_PARTITION}={partition!r}: {e}"
    if built == list(planned.value):
        return None
    return (f"loadplan plan {plan.plan_id} gives pp rank {parallel.pp_rank} of {parallel.pp_size} layers "
            f"[{planned.value[0]}, {planned.value[1]}) (SGLang's default partition of {n_layers} layers), but "
            f"{ENV_PP_LAYER_PARTITION}={partition!r} makes SGLang build [{built[0]}, {built[1]}); the registry "
            f"cannot plan that partition: unset {ENV_PP_LAYER_PARTITION}, or start this deployment without "
            f"the loadplan adapter")


def _summary(plan: LoadPlan) -> str:
    keys = (Keys.SHARED_EXPERTS_FUSION, Keys.FORWARD_PATH, Keys.POST_EXPERTS_ALL_REDUCE, Keys.PP_LAYER_RANGE)
    return ", ".join(f"{k}={plan.decisions[k].value!r}" for k in keys if k in plan.decisions)


def _refuse_or_fall_back(request: ResolveRequest, e: Exception) -> None:
    from loadplan.client.errors import RegistryCallError, UnavailableError

    what = f"{request.role} runner of deployment {request.deployment_id}"
    unreachable = isinstance(e, UnavailableError) or not isinstance(e, RegistryCallError)
    if unreachable and _options is not None and _options.allow_fallback:
        log.error("LOADPLAN REGISTRY UNREACHABLE (%s): the %s falls back to SGLang's own decision, "
                  "which no plan records (allow_fallback is set)", e, what)
        return
    if unreachable:
        raise LoadPlanRefused(f"loadplan registry at {_options.registry if _options else '?'} is unreachable "
                              f"after the client's retries ({e}); the {what} does not start") from e
    raise LoadPlanRefused(f"loadplan registry refused the {what}: {e}") from e


def _registry():
    global _client
    with _lock:
        if _client is None:
            from loadplan.client import RegistryClient

            _client = RegistryClient(_options.registry, timeout=_options.timeout, token=_options.token)
        return _client


# --- the runner's identity, read from SGLang's state -----------------------------


def runner_request(model_class, hf_config, quant_config, *, deployment: str | None = None) -> ResolveRequest:
    """What this runner asks: SGLang's published ranks, flags and this checkpoint's config."""
    import torch
    from sglang.srt.runtime_context import get_exec, get_flags, get_parallel, get_server_args

    parallel, moe = get_parallel(), get_exec().moe
    role = ROLE_SPECULATIVE if get_flags().moe.in_speculative_scope else ROLE_TARGET
    attn_dp = int(parallel.attn_dp_size or 1)
    config = _config_dict(hf_config)
    quant_cfg = config.get("quantization_config")
    deployment = deployment or _default_deployment(get_server_args())
    ranks = Parallel(
        # loadplan's tp x ep is SGLang's tp group (DESIGN 8.1): its MoE-TP and EP factors.
        tp_size=int(parallel.moe_tp_size), tp_rank=int(parallel.moe_tp_rank),
        ep_size=int(parallel.moe_ep_size), ep_rank=int(parallel.moe_ep_rank),
        pp_size=int(parallel.pp_size), pp_rank=int(parallel.pp_rank),
        dp_size=attn_dp, dp_rank=int(parallel.attn_dp_rank) if attn_dp > 1 else 0,
    )
    runtime = Runtime(
        a2a_backend=str(moe.moe_a2a_backend or "none"),
        device=_device(torch),
        engine=ENGINE_SGLANG,
        engine_version=sglang_version() or "",
        moe_runner_backend=str(moe.moe_runner_backend or "auto"),
        enable_sbo=bool(get_exec().overlap.enable_single_batch_overlap),
        enable_tbo=bool(get_exec().overlap.enable_two_batch_overlap),
        disable_shared_experts_fusion=bool(moe.disable_shared_experts_fusion),
        enforce_shared_experts_fusion=bool(moe.enforce_shared_experts_fusion),
        enable_eplb=bool(moe.enable_eplb),
        ep_num_redundant_experts=int(moe.ep_num_redundant_experts or 0),
        **engine_inputs_of(get_server_args()),
        upgrade_from=os.environ.get(ENV_UPGRADE_FROM, "").strip(),
    )
    return ResolveRequest(
        request_id=f"sglang-{uuid.uuid4().hex}",
        deployment_id=deployment,
        role=role,
        parallel=ranks,
        host=socket.gethostname()[:255],
        config=config,
        quantization_config=quant_cfg if isinstance(quant_cfg, dict) else None,
        quantization=quant_config.get_name() if quant_config is not None else None,
        runtime=runtime,
    )


def engine_inputs_of(server_args, environ=os.environ) -> dict[str, dict[str, str]]:
    """The server arguments and environment switches the sglang profile reads (loadplan/engine_inputs.py), from
    this server's real ServerArgs and environment: the arguments as text (Python's str of the value; None as
    SGLang's "none" where the profile says so), the switches as set (an unset one is not sent: its default holds)."""
    from ..engine_inputs import names

    args = {n: str(getattr(server_args, n)) for n in names(ENGINE_SGLANG, "arg") if hasattr(server_args, n)}
    if args.get("moe_a2a_backend") == "None":
        args["moe_a2a_backend"] = "none"
    if args.get("moe_runner_backend") == "None":
        args["moe_runner_backend"] = "auto"
    env = {n: environ[n] for n in names(ENGINE_SGLANG, "env") if n in environ}
    return {"engine_args": args, "engine_env": env}


def _config_dict(hf_config) -> dict[str, Any]:
    raw = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    return json.loads(json.dumps(raw, default=str))


def _device(torch) -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"{'hip' if torch.version.hip else 'cuda'}:{major}.{minor}"


def _default_deployment(server_args) -> str:
    """Without --deployment: the served model's name, the same on every rank of one server."""
    name = getattr(server_args, "served_model_name", None) or os.path.basename(
        str(getattr(server_args, "model_path", "model")).rstrip("/"))
    clean = "".join(c if c.isalnum() or c in "._-" else "-" for c in str(name)).strip("-.") or "model"
    return f"sglang-{clean}"[:128]
