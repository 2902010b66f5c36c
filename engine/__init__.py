"""loadplan's torch MoE engine.

`loadplan.engine.loader.load_model` is the single instantiation point: it asks the
registry for this runner's plan, builds the model from it and loads the weights.
Model-file conventions: `loadplan.engine.models`; the entry-class table:
`loadplan.engine.registry`; greedy decoding: `loadplan.engine.generate`.
"""

# `from loadplan.engine import load_model` without paying torch's import for every other
# `loadplan.engine.*` import (the CLI imports engine modules that need no torch): resolved on
# first use (PEP 562).
__all__ = ["load_model"]


def __getattr__(name: str):
    if name == "load_model":
        from .loader import load_model
        return load_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
