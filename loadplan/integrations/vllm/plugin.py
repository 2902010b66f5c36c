"""The entry point vLLM calls in each of its processes, and the hook on its instantiation point."""

from __future__ import annotations

import contextvars
import functools
import importlib.abc
import importlib.util
import sys
import time

from .settings import Settings, settings_from

# A model file may build a sub-model through initialize_model (models/utils.py:
# init_vllm_registered_model, a multimodal wrapper's text body): the runner's plan is
# resolved once, by the outermost call.
_INSIDE = contextvars.ContextVar("loadplan_inside_initialize_model", default=False)


UTILS = "vllm.model_executor.model_loader.utils"
BASE_LOADER = "vllm.model_executor.model_loader.base_loader"


def register() -> None:
    """`vllm.general_plugins` entry point: hook initialize_model when $LOADPLAN_REGISTRY is set.
    Called once per vLLM process (and harmless when called again)."""
    settings = settings_from()
    if settings is None:
        return
    if UTILS in sys.modules:
        hook_module(sys.modules[UTILS], settings)
        if BASE_LOADER in sys.modules:     # it imported the function by name: point it at the hook too
            sys.modules[BASE_LOADER].initialize_model = sys.modules[UTILS].initialize_model
    elif not any(isinstance(f, HookOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, HookOnImport(settings))


def hook_module(utils, settings: Settings) -> None:
    if getattr(utils.initialize_model, "loadplan_settings", None) is None:
        utils.initialize_model = hook(utils.initialize_model, settings)


class HookOnImport(importlib.abc.MetaPathFinder):
    """Hooks initialize_model as vLLM's model loader is first imported, before base_loader imports
    the name. The processes that never build a model (the front end, the engine core) never import
    the model loader, and the plugin does not make them (seconds of imports)."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def find_spec(self, fullname, path, target=None):
        if fullname != UTILS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, settings = spec.loader.exec_module, self.settings

        def exec_then_hook(module):
            exec_module(module)
            hook_module(module, settings)

        spec.loader.exec_module = exec_then_hook
        return spec


def hook(initialize_model, settings: Settings):
    @functools.wraps(initialize_model)
    def initialize_model_with_plan(vllm_config, *, prefix: str = "", model_class=None, model_config=None):
        if _INSIDE.get():
            return initialize_model(vllm_config, prefix=prefix, model_class=model_class, model_config=model_config)
        from vllm.model_executor.model_loader.utils import get_model_architecture

        model_config = model_config if model_config is not None else vllm_config.model_config
        if model_class is None:
            model_class, _ = get_model_architecture(model_config)
        plan = plan_for_worker(settings, vllm_config, model_config, model_class)
        token = _INSIDE.set(True)
        try:
            model = initialize_model(vllm_config, prefix=prefix, model_class=model_class, model_config=model_config)
        finally:
            _INSIDE.reset(token)
        # Where an operator finds it: the plan id in the worker's log and on the model.
        model.loadplan_plan_id = plan.plan_id
        model.loadplan_plan = plan
        return model

    initialize_model_with_plan.loadplan_settings = settings
    return initialize_model_with_plan


def plan_id_of(model) -> str | None:
    """The id of the plan a vLLM model was built from (None: built without the plugin). For an
    operator: `LLM.apply_model(plan_id_of)` answers one id per worker."""
    return getattr(model, "loadplan_plan_id", None)


def plan_for_worker(settings: Settings, vllm_config, model_config, model_class):
    """Resolve this runner's plan and check it against what vLLM is about to build; PlanRefused if not."""
    started = time.perf_counter()         # what the plugin adds to a worker's start, client import included
    from vllm.logger import init_logger

    from loadplan.client import RegistryCallError, RegistryClient
    from loadplan.client.errors import NotFoundError
    from loadplan.plan import Keys
    from .agreement import PlanRefused, check_agreement
    from .built import about_to_build
    from .identity import identity_of, resolve_request

    logger = init_logger("vllm.plugins.loadplan")
    request = resolve_request(identity_of(vllm_config, model_config), settings.deployment, settings.upgrade_from)
    p = request.parallel
    who = (f"deployment {request.deployment_id}, role {request.role}, tp {p.tp_rank}/{p.tp_size}, "
           f"ep {p.ep_rank}/{p.ep_size}, pp {p.pp_rank}/{p.pp_size}, dp {p.dp_rank}/{p.dp_size}")
    asked = time.perf_counter()
    built = about_to_build(vllm_config, model_config, model_class)
    try:
        with RegistryClient(settings.registry) as client:
            try:
                plan = client.resolve_load_plan(request)
            except NotFoundError as e:
                if e.field != "runtime.engine_version":
                    raise
                # A vLLM release the registry has no profile of: vLLM decides, the registry records it.
                shared = getattr(model_config.hf_text_config, "n_shared_experts", 0) or 0
                plan = client.record_observed_plan(request, observed(built, shared))
    except RegistryCallError as e:
        raise PlanRefused(f"loadplan: the registry at {settings.registry} refused the plan of {who}: {e}") from e
    answered = time.perf_counter()
    check_agreement(plan, built)
    done = time.perf_counter()
    logger.info("loadplan: plan %s for %s (%s, %s)%s; resolved in %.1f ms, plugin %.1f ms in all",
                plan.plan_id, who, plan.entry_class, plan.value(Keys.ENGINE_PROFILE),
                " OBSERVED (no profile of this vLLM release: vLLM decided)" if plan.observed else "",
                (answered - asked) * 1e3, (done - started) * 1e3)
    return plan


def observed(built, n_shared_experts: int) -> list:
    """What vLLM decided, as the decisions an observed plan records: every deployment-wide one the plugin reads of
    vLLM's own code (the stage's layer range is the nearest profile's, and check_agreement still compares it)."""
    from loadplan.plan import Decision, Keys

    keys = (Keys.FORWARD_PATH, Keys.POST_EXPERTS_ALL_REDUCE, Keys.SHARED_EXPERTS_FUSION)
    out = [Decision(b.key, b.value, f"vLLM built it: {b.source}", "vllm.plugin") for b in built if b.key in keys]
    fused = next((b.value for b in built if b.key == Keys.SHARED_EXPERTS_FUSION), False)
    # vLLM's fusing model files (AITER on ROCm) append every shared expert of the checkpoint to the routed ones
    return out + [Decision(Keys.NUM_FUSED_SHARED_EXPERTS, int(n_shared_experts) if fused else 0,
                           "the shared experts vLLM fused", "vllm.plugin")]
