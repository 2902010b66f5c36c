"""The engine's view of the shared entry-class table (`loadplan.entry_classes`), with lazy imports.

An entry class is `architectures[0]` of a checkpoint's config.json. The shared table's row
names the module that builds it, as a string; nothing is imported until a model is built, so
listing what the engine supports costs nothing. `ENGINE_WRAPPERS` says which inner
entry class a wrapper builds (and from which part of its config), so the coverage
check can compare the engine's chains with the registry's (`engine_chain`).

Adding a model family:
1. write `engine/models/<family>.py` following the conventions in
   `loadplan.engine.models` (constructor `(hf_config: dict, plan: GuardedPlan, *,
   dtype)`, `load_weights`, `routed_experts_weights_of_layer`, ...);
2. add its row to `loadplan/entry_classes.py` (the one table: the registry reads it too),
   naming the module; a family with shared experts needs a gate or a never-fuses row in
   `service/rules/entries.py`'s families: `loadplan coverage` checks both.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from loadplan.entry_classes import ENTRY_CLASSES, engine_module

# entry class -> (module, class name): the rows of the shared table that the engine builds (the class of the
# same name in the row's module; rules-only rows are not here).
ENGINE_ENTRY_CLASSES: dict[str, tuple[str, str]] = {
    name: (engine_module(name), name) for name, row in ENTRY_CLASSES.items() if not row.rules_only
}


@dataclass(frozen=True)
class EngineWrapper:
    inner: str            # the entry class its constructor builds
    config_field: str     # the part of its config that constructor receives


# Wrappers: their engine class builds `inner` from `config[config_field]` (the shared table's wrapper rows).
ENGINE_WRAPPERS: dict[str, EngineWrapper] = {
    name: EngineWrapper(row.inner, row.config_field)
    for name, row in ENTRY_CLASSES.items() if row.is_wrapper and name in ENGINE_ENTRY_CLASSES
}


class UnsupportedModel(ValueError):
    """An entry class the engine cannot build."""


def supported() -> list[str]:
    return sorted(ENGINE_ENTRY_CLASSES)


def _check(name: str) -> None:
    if name not in ENGINE_ENTRY_CLASSES:
        raise UnsupportedModel(f"entry class {name!r} not supported by the engine; supported: {', '.join(supported())}")


def model_class(name: str) -> type:
    """The engine class for entry class `name` (imports its module on first use)."""
    _check(name)
    module, cls = ENGINE_ENTRY_CLASSES[name]
    return getattr(importlib.import_module(module), cls)


def engine_chain(name: str, wrappers: dict[str, EngineWrapper] | None = None) -> tuple[str, ...]:
    """`name`, then each inner class its wrappers build, outermost first (like the registry's chain_of)."""
    wrappers = ENGINE_WRAPPERS if wrappers is None else wrappers
    _check(name)
    chain = [name]
    while chain[-1] in wrappers:
        inner = wrappers[chain[-1]].inner
        if inner in chain:
            raise UnsupportedModel(f"engine wrapper cycle: {' -> '.join(chain + [inner])}")
        chain.append(inner)
    return tuple(chain)
