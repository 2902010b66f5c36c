"""Linear weights stored as packed integers with per-group scales and zero points (the GPTQ and AWQ checkpoint
formats: engine/gptq.py, engine/awq.py), shown to the loader as the plain weights they stand for.

A quantized linear layer X of weight W [N, K] (N outputs, K inputs) is stored as
    X.qweight  int32   b-bit values q, packed 32/b to a word (along K for GPTQ, along N for AWQ)
    X.qzeros   int32   b-bit zero points z, one per group of inputs and output, packed along N
    X.scales   float   [G, N], one scale per group and output
    X.g_idx    int32   [K], each input's group (GPTQ; without it input k is in group k // group_size)
and W[n, k] = scales[g, n] * (q[k, n] - z[g, n]) with g the group of input k. `PackedLinearCheckpoint` shows
each such X as `X.weight`, dequantized to float32 when it is read, its parts hidden; the format says how its
words unpack. A quantizer that stores a bias for every layer it packs writes zeros for a layer that has none:
such an all-zero `X.bias` is hidden too (a real bias is kept). A part without its `qweight`, a `qweight`
without its parts, or shapes that do not fit are errors naming the tensor.
"""

from __future__ import annotations

from typing import Callable

import torch

from .weights import DuplicateTensor, MissingTensor, ShapeMismatch

QWEIGHT, QZEROS, SCALES, G_IDX = "qweight", "qzeros", "scales", "g_idx"
PARTS = (QZEROS, SCALES)


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., M] -> int64 [..., M, 32 / bits]: each word's b-bit values, lowest bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    return ((words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


class PackedLinearCheckpoint:
    """A checkpoint (names / shape / get) whose packed layers read as float32 `X.weight`.

    `dequantize(parts, module) -> W [N, K]` and `weight_shape(parts, module) -> (N, K)` are the format's; `parts`
    maps a part's name (qweight, qzeros, scales, g_idx) to its tensor (for `weight_shape`: its shape)."""

    def __init__(self, ckpt, dequantize: Callable, weight_shape: Callable, optional: tuple[str, ...] = ()):
        self.ckpt = ckpt
        self._dequantize, self._weight_shape = dequantize, weight_shape
        self._optional = optional
        names = ckpt.names()
        self._held = held = set(names)
        self._packed: dict[str, str] = {}                   # X.weight -> X
        hidden: set[str] = set()
        for name in names:
            module, _, leaf = name.rpartition(".")
            if leaf in (*PARTS, *optional) and f"{module}.{QWEIGHT}" not in held:
                raise MissingTensor(f"{name!r} belongs to {module + '.' + QWEIGHT!r}, which is not in the checkpoint")
            if leaf != QWEIGHT:
                continue
            for part in PARTS:
                if f"{module}.{part}" not in held:
                    raise MissingTensor(f"{module + '.' + part!r} is missing: {name!r} cannot be dequantized")
            if f"{module}.weight" in held:
                raise DuplicateTensor(f"{module + '.weight'!r} is in the checkpoint both plain and packed")
            self._packed[f"{module}.weight"] = module
            hidden.update(f"{module}.{p}" for p in (QWEIGHT, *PARTS, *optional))
            bias = f"{module}.bias"
            if bias in held and not ckpt.get(bias).any():
                hidden.add(bias)
        self._names = [n for n in names if n not in hidden] + list(self._packed)

    def names(self) -> list[str]:
        return list(self._names)

    def _parts(self, module: str, read) -> dict:
        names = (QWEIGHT, *PARTS, *(p for p in self._optional if f"{module}.{p}" in self._held))
        return {p: read(f"{module}.{p}") for p in names}

    def shape(self, name: str) -> tuple[int, ...]:
        module = self._packed.get(name)
        if module is None:
            return tuple(self.ckpt.shape(name))
        return self._weight_shape(self._parts(module, lambda n: tuple(self.ckpt.shape(n))), module)

    def get(self, name: str) -> torch.Tensor:
        module = self._packed.get(name)
        if module is None:
            return self.ckpt.get(name)
        parts = self._parts(module, self.ckpt.get)
        if parts[QWEIGHT].dtype != torch.int32 or parts[QZEROS].dtype != torch.int32:
            raise ShapeMismatch(f"{module + '.' + QWEIGHT!r} and {module + '.' + QZEROS!r} are "
                                f"{parts[QWEIGHT].dtype} and {parts[QZEROS].dtype}; expected torch.int32 words")
        return self._dequantize(parts, module)
