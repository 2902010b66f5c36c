"""A shared-memory weight cache: a runner's assigned state dict in one file (e.g. under /dev/shm).

Loading it memory-maps the file (`torch.load(mmap=True)`), so several workers on
one host share the pages, and assigns the tensors straight into the model built
from the plan: no checkpoint reading, no name remapping, no `load_weights`. That is
the path that once left EPLB descriptors unattached (DESIGN 1); here they come
from the model's construction and resolve lazily.

The file records the layout it was made for (the model's `weight_layout()`, entry
class, dtype); a model built by a different plan layout (fused vs unfused, another
stage or expert range) is refused with the difference named, never assigned.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from .weights import LayoutMismatch, assign_state_dict

FORMAT = "loadplan.weight_cache.v1"


def _signature(model: nn.Module) -> dict:
    return {
        "format": FORMAT,
        "entry_class": model.plan.entry_class,
        "config_fingerprint": model.plan.config_fingerprint,
        "dtype": str(next(model.parameters()).dtype),
        "layout": {k: list(v) if isinstance(v, tuple) else v
                   for k, v in dataclasses.asdict(model.weight_layout()).items()},
    }


def save_weight_cache(model: nn.Module, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"signature": _signature(model), "state": model.state_dict()}, tmp)
    tmp.replace(path)   # readers never see a half-written cache
    return path


def load_weight_cache(model: nn.Module, path: str | Path, *, device: str | torch.device = "cpu") -> None:
    blob = torch.load(Path(path), mmap=True, weights_only=True, map_location="cpu")
    mine, theirs = _signature(model), blob.get("signature", {})
    if theirs.get("format") != FORMAT:
        raise LayoutMismatch(f"{path}: not a loadplan weight cache (format {theirs.get('format')!r})")
    diff = [k for k in ("entry_class", "config_fingerprint", "dtype") if mine[k] != theirs.get(k)]
    diff += [f"layout.{k}" for k in mine["layout"] if mine["layout"][k] != theirs.get("layout", {}).get(k)]
    if diff:
        detail = ", ".join(f"{k}: cache {_get(theirs, k)!r} vs model {_get(mine, k)!r}" for k in diff)
        raise LayoutMismatch(f"{path} was built for another layout than plan {model.plan.plan_id}: {detail}")
    state = blob["state"]
    if torch.device(device).type != "cpu":
        state = {k: v.to(device) for k, v in state.items()}
    assign_state_dict(model, state)


def _get(sig: dict, key: str):
    if key.startswith("layout."):
        return sig.get("layout", {}).get(key[len("layout."):])
    return sig.get(key)
