"""loadplan's vLLM plugin: every vLLM worker resolves its load plan before it builds the model.

Registered in the `vllm.general_plugins` entry-point group of the loadplan distribution, so vLLM
loads it in each of its processes (`vllm/plugins/__init__.py`). It is inert unless
$LOADPLAN_REGISTRY names a registry (settings.py); then, in every call of vLLM's single
instantiation point `model_loader/utils.py: initialize_model`, it

1. resolves this runner's plan (`runtime.engine = "vllm"`) with the identity vLLM holds
   (identity.py),
2. asks vLLM's own decision code what it is about to build (built.py) and stops the worker
   if the plan disagrees (agreement.py); a refused plan stops it with the registry's message,
3. logs the plan id and attaches the plan to the built model (`model.loadplan_plan_id`,
   `model.loadplan_plan`; `LLM.apply_model(plan_id_of)` asks every worker).

Only `register` is imported at plugin load time; vLLM is imported when the plugin is active.
"""

from .plugin import plan_id_of, register

__all__ = ["register", "plan_id_of"]
