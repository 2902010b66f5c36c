"""Greedy decoding with a static KV cache (gpt-fast style).

Prefill the prompt once, then feed one token at a time at its absolute position.
The model keeps no decision state to read here: it was all baked in at build time.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def eos_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    """The token ids that end generation (none: run to max_new_tokens)."""
    if eos_token_id is None:
        return frozenset()
    return frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, *,
             eos_token_id: int | Sequence[int] | None = None) -> torch.Tensor:
    """prompt_ids [T] or [B, T] -> the new tokens [B, N] (N <= max_new_tokens; all rows stop at EOS together
    only when every row has produced one)."""
    if getattr(model, "drafts_from_target_hidden", False):
        raise ValueError(f"{type(model).__name__} predicts from a target's hidden states: it drafts for a target "
                         f"(engine.speculative.speculative_generate), it does not generate alone")
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.numel() == 0:
        raise ValueError("empty prompt")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    ids = ids.to(device)
    B, T = ids.shape
    if max_new_tokens == 0:
        return ids.new_zeros((B, 0))
    eos = eos_set(eos_token_id)
    model.setup_caches(B, T + max_new_tokens)
    try:
        logits = model(ids, torch.arange(T, device=device))               # [B, T, V]
        nxt = logits[:, -1].argmax(dim=-1)                                 # [B]
        out = [nxt]
        # Rows that have produced an EOS, kept on the host: without EOS ids there is nothing to sync per step.
        done = [t in eos for t in nxt.tolist()] if eos else [False] * B
        for pos in range(T, T + max_new_tokens - 1):
            if eos and all(done):
                break
            logits = model(nxt[:, None], torch.tensor([pos], device=device))
            nxt = logits[:, -1].argmax(dim=-1)
            out.append(nxt)
            if eos:
                done = [d or t in eos for d, t in zip(done, nxt.tolist())]
        return torch.stack(out, dim=1)
    finally:
        model.clear_caches()


def generate_from_checkpoint(path, prompt_ids: Sequence[int], max_new_tokens: int, **load_kwargs) -> dict:
    """What `loadplan generate --json` prints: {"tokens": [...], "plan_id": ...}.

    load_kwargs go to `load_model` (registry, runtime flags as for resolve, dtype, ...)."""
    from .loader import load_model

    model = load_model(path, **load_kwargs)
    eos = checkpoint_eos(path)
    tokens = generate(model, list(prompt_ids), max_new_tokens, eos_token_id=eos)[0].tolist()
    return {"tokens": tokens, "plan_id": model.plan.plan_id}


def checkpoint_eos(path) -> list[int]:
    """The ids that end generation, as transformers reads them: generation_config.json, else config.json."""
    import json
    from pathlib import Path

    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []
