"""The single-process reference of the multi-rank engine tests (their checkpoints: tests/engine/families.py).

Rank functions live in the test modules (module level, so the launcher can pickle
them); what they share is here, importable by name in the ranks too.
"""

from __future__ import annotations

import torch

from engine_helpers import LocalRegistry, load_kwargs


def single_process(path: str, ids: torch.Tensor, n_new: int, **load_kw) -> tuple[torch.Tensor, list[int]]:
    """(logits of `ids`, greedy tokens after ids[0]) of one process holding every layer and expert."""
    from loadplan.engine.generate import generate
    from loadplan.engine.loader import load_model

    model = load_model(path, registry=LocalRegistry(), **load_kwargs(**load_kw))
    with torch.no_grad():
        logits = model(ids)
    return logits, generate(model, ids[0], n_new)[0].tolist()
