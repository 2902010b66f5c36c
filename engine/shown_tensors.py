"""`ShownTensors`: a checkpoint shown to the weight remapping under other names, some tensors reshaped.

A family whose checkpoints arrange tensors otherwise than the engine builds them shows the checkpoint (`names`,
`shape`, `get`, as engine/checkpoint.py's readers) through one of these: each shown name reads one checkpoint
tensor, whole or through a function of it (a slice of a fused projection, a reshape, a transposed expert), with
the shape that function gives. What a family shows is a table built once (`show`); nothing is read until `get`.

Its views: `renamed` (a wrapper's prefixes: models/qwen3_vl_moe.py and the wrappers and drafts built like it),
`rows_by_rank` (a fused projection's parts regrouped by tensor-parallel rank: the linear-attention, Mamba and Mamba2
layers), ERNIE-4.5's routing bias of one group (models/ernie4_5_moe.py), Granite's experts and halved shared MLP
(models/granitemoe.py) and DBRX's fused q/k/v and flattened experts (models/dbrx.py).
"""

from __future__ import annotations

from typing import Callable

import torch


class ShownTensors:
    """`ckpt` as `show` lays it out; `source_name(shown)` is the checkpoint's name of a shown tensor (for errors)."""

    def __init__(self, ckpt):
        self._ckpt = ckpt
        # shown name -> (checkpoint name, its shape as shown, how to take it from the checkpoint's tensor)
        self._shown: dict[str, tuple[str, tuple[int, ...], Callable[[torch.Tensor], torch.Tensor] | None]] = {}
        self._last: tuple[str | None, torch.Tensor | None] = (None, None)   # the source last read through a function

    def show(self, shown: str, source: str, shape: tuple[int, ...] | None = None,
             take: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Show checkpoint tensor `source` as `shown`: whole, or `take(tensor)` of shape `shape`."""
        self._shown[shown] = (source, tuple(self._ckpt.shape(source)) if shape is None else tuple(shape), take)

    def names(self) -> list[str]:
        return list(self._shown)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shown[name][1]

    def source_name(self, name: str) -> str:
        """The checkpoint's own name for shown tensor `name` (through the views under this one)."""
        source = self._shown[name][0] if name in self._shown else name
        inner = getattr(self._ckpt, "source_name", None)
        return inner(source) if inner is not None else source

    def get(self, name: str) -> torch.Tensor:
        source, _, take = self._shown[name]
        if take is None:
            return self._ckpt.get(source)
        held, tensor = self._last
        if held != source:                  # the parts of one tensor (each expert of a flattened matrix) read it once
            tensor = self._ckpt.get(source)
            self._last = (source, tensor)
        return take(tensor).contiguous()


def renamed(ckpt, prefixes: tuple[tuple[str, str], ...]) -> ShownTensors:
    """`ckpt` with the first matching prefix of each name replaced ((old, new) pairs)."""
    view = ShownTensors(ckpt)
    for name in ckpt.names():
        view.show(next((new + name[len(old):] for old, new in prefixes if name.startswith(old)), name), name)
    return view


def rows_by_rank(ckpt, tp_size: int, layouts: dict[str, tuple[list[int], list[bool]]],
                 prefixes: tuple[str, ...] = ("",)) -> ShownTensors:
    """`ckpt` with each tensor named `prefix + suffix` (a prefix of `prefixes`, a suffix of `layouts`) shown with its
    rows regrouped rank by rank, so that weights.TP_SPLITS' contiguous split gives each rank its own rows. `layouts`:
    suffix -> (the row counts of the tensor's parts, in order; for each, whether it is whole on every rank, repeated,
    instead of cut in tp_size blocks). E.g. parts [q, k, v] become [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]. A tensor whose
    rows are not its parts' sum is shown as it is: the loader's shape check refuses it, named."""
    view = ShownTensors(ckpt)
    for name in ckpt.names():
        suffix = next((x for x in layouts if name.endswith(x) and name[:-len(x)].startswith(prefixes)), None)
        shape = tuple(ckpt.shape(name))
        if suffix is None or not shape or shape[0] != sum(layouts[suffix][0]):
            view.show(name, name)
            continue
        parts, whole = layouts[suffix]
        per_rank = sum(p if w else p // tp_size for p, w in zip(parts, whole))

        def take(t: torch.Tensor, parts=parts, whole=whole) -> torch.Tensor:
            pieces = [[p] * tp_size if w else p.chunk(tp_size) for p, w in zip(t.split(parts), whole)]
            return torch.cat([torch.cat(rank) for rank in zip(*pieces)])
        view.show(name, name, (tp_size * per_rank, *shape[1:]), take)
    return view
