"""Checkpoints that keep each layer's experts in one stacked tensor, shown one expert at a time.

transformers saves some families' experts stacked, transposed for `x @ W`:
`{block}.experts.gate_up_proj` [E, D, 2I], `{block}.experts.down_proj` [E, I, D], and for
gpt-oss their biases `gate_up_proj_bias` [E, 2I], `down_proj_bias` [E, D]. The gate and up
halves of the last dimension are either interleaved (gpt-oss: gate = [..., 0::2], up =
[..., 1::2]) or concatenated (Llama 4: gate = [..., :I], up = [..., I:]).

Some exports keep the experts as the model holds them instead, not transposed (transformers'
own save of Qwen3-VL-MoE: `gate_up_proj` [E, 2I, D], `down_proj` [E, D, I]); given the
model's hidden size and expert width, `StackedExperts` tells the two apart by shape (and
refuses a shape that fits both, or neither).

`StackedExperts` shows such a checkpoint (`names`/`shape`/`get`) to the weight remapping
(engine/weights.py) in the per-expert spelling, `{block}.experts.{e}.gate_proj.weight`
[I, D], `up_proj.weight`, `down_proj.weight` [D, I] and their `.bias`, so EP shares, EPLB
replicas, TP splits and the hard checks are those of every family; `{block}` stays as the
checkpoint spells it (`mlp`, `feed_forward`: a family's `CheckpointNames` maps it). A
stacked tensor's first dimension must be the config's expert count. The last stacked
tensor read is kept, so reading its experts one after another reads it once.
"""

from __future__ import annotations

import re

import torch

from .weights import ShapeMismatch

_STACKED = re.compile(r"^(?P<block>.+\.(?:mlp|feed_forward))\.experts\."
                      r"(?P<kind>gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")
GATE_UP_LAYOUTS = ("interleaved", "concatenated")


class StackedExperts:
    def __init__(self, ckpt, n_experts: int, *, gate_up: str, hidden_size: int | None = None,
                 expert_width: int | None = None, as_held: bool = False):
        """`hidden_size` and `expert_width` (D, I), when given, let a stacked matrix come either way round
        ([E, D, 2I] or [E, 2I, D]; [E, I, D] or [E, D, I]); without them it must be transposed for x @ W.
        `as_held`: the family's checkpoints always keep them as the model holds them (Granite MoE's; then D and
        I, which may not tell the two apart, e.g. 2I == D, check the shapes)."""
        if gate_up not in GATE_UP_LAYOUTS:
            raise ValueError(f"gate_up={gate_up!r}: one of {', '.join(GATE_UP_LAYOUTS)}")
        self._ckpt = ckpt
        self._interleaved = gate_up == "interleaved"
        self._dims = (hidden_size, expert_width) if hidden_size and expert_width else None
        self._always_held = as_held
        self._as_held: set[str] = set()                          # stacked matrices not transposed for x @ W
        self._parts: dict[str, tuple[str, int, str]] = {}    # shown name -> (stacked name, expert, piece)
        self._names: list[str] = []
        self._last: tuple[str | None, torch.Tensor | None] = (None, None)   # the stacked tensor last read
        for name in ckpt.names():
            m = _STACKED.match(name)
            if m is None:
                self._names.append(name)
                continue
            shape = tuple(ckpt.shape(name))
            kind = m["kind"]
            dims = 2 if kind.endswith("_bias") else 3
            if len(shape) != dims or shape[0] != n_experts or (kind.startswith("gate_up") and shape[-1] % 2):
                raise ShapeMismatch(f"tensor {self._source(name)!r} has shape {list(shape)}: expected {dims} "
                                    f"dimensions, the first num_local_experts={n_experts}"
                                    + (", the last even (gate and up)" if kind.startswith("gate_up") else ""))
            if dims == 3 and (self._always_held or self._dims is not None) and \
                    self._held_as_the_model_holds(name, kind, shape):
                self._as_held.add(name)
            tensor = "bias" if kind.endswith("_bias") else "weight"
            pieces = ("gate", "up") if kind.startswith("gate_up") else ("down",)
            for e in range(n_experts):
                for piece in pieces:
                    shown = f"{m['block']}.experts.{e}.{piece}_proj.{tensor}"
                    self._parts[shown] = (name, e, piece)
                    self._names.append(shown)

    def _source(self, name: str) -> str:
        """The checkpoint's own name for `name`, where the view under this one renamed it (`source_name`: Granite's),
        so that an error names the tensor as the checkpoint spells it."""
        source = getattr(self._ckpt, "source_name", None)
        return source(name) if source is not None else name

    def _held_as_the_model_holds(self, name: str, kind: str, shape: tuple[int, ...]) -> bool:
        """Is this [E, a, b] matrix the model's orientation (True) or transposed for x @ W (False)?"""
        if self._dims is None:               # always held, nothing to check it against
            return True
        D, I = self._dims
        transposed, held = ((D, 2 * I), (2 * I, D)) if kind == "gate_up_proj" else ((I, D), (D, I))
        if self._always_held:
            if shape[1:] != held:
                raise ShapeMismatch(f"tensor {self._source(name)!r} has shape {list(shape)}: expected [E, {held[0]}, "
                                    f"{held[1]}]")
            return True
        if shape[1:] not in (transposed, held):
            raise ShapeMismatch(f"tensor {self._source(name)!r} has shape {list(shape)}: expected [E, {transposed[0]}, "
                                f"{transposed[1]}] (or as the model holds it, [E, {held[0]}, {held[1]}])")
        if transposed == held:
            raise ShapeMismatch(f"tensor {self._source(name)!r} has shape {list(shape)}, which fits both orientations "
                                f"(hidden size {D}, expert width {I}): which way round it is cannot be told")
        return shape[1:] == held

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        part = self._parts.get(name)
        if part is None:
            return tuple(self._ckpt.shape(name))
        stacked, _, piece = part
        shape = tuple(self._ckpt.shape(stacked))
        if stacked in self._as_held:                              # [E, 2I, D] / [E, D, I]: seen as x @ W's
            shape = (shape[0], shape[2], shape[1])
        if len(shape) == 2:                                       # [E, 2I] or [E, D]
            return (shape[1] // 2,) if piece != "down" else (shape[1],)
        if piece == "down":                                       # [E, I, D] -> [D, I]
            return (shape[2], shape[1])
        return (shape[2] // 2, shape[1])                          # [E, D, 2I] -> [I, D]

    def get(self, name: str) -> torch.Tensor:
        part = self._parts.get(name)
        if part is None:
            return self._ckpt.get(name)
        stacked, e, piece = part
        if self._last[0] != stacked:
            self._last = (stacked, self._ckpt.get(stacked))
        t = self._last[1][e]                                      # [D, 2I], [2I], [I, D] or [D]
        if stacked in self._as_held:
            t = t.t()
        if piece != "down":
            if self._interleaved:
                t = t[..., 0::2] if piece == "gate" else t[..., 1::2]
            else:
                half = t.shape[-1] // 2
                t = t[..., :half] if piece == "gate" else t[..., half:]
        return t.t() if t.dim() == 2 else t
