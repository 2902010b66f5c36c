"""AWQ checkpoints (AutoAWQ's `quant_method: awq`, version gemm), dequantized as they are read.

config.json: `quantization_config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true,
"version": "gemm"}` (AutoAWQ's own spelling `w_bit`, `q_group_size` read too). Each quantized linear layer X
of weight W [N, K] is stored as engine/packed_linear.py describes, AWQ's way:
- `qweight` int32 [K, N / 8] and `qzeros` int32 [K / group_size, N / 8]: 4-bit values packed along the
  outputs, interleaved: the word's 4-bit slot i (bits 4i..4i+3) holds output 8c + AWQ_ORDER[i] of word c;
- `scales` [K / group_size, N];
and W[n, k] = scales[g, n] * (q[k, n] - z[g, n]) with g = k // group_size (zero points as stored).
4 bits only; the gemv and other kernel layouts, and zero_point false, are refused by field.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .packed_linear import QWEIGHT, QZEROS, SCALES, PackedLinearCheckpoint, unpack_words
from .weights import ShapeMismatch, refuse_unless

BITS = 4
PER_WORD = 32 // BITS
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # slot i of a word holds output AWQ_ORDER[i] of its eight
VERSIONS = ("gemm",)


class AwqConfigError(ValueError):
    """A quantization_config the engine cannot read as AWQ weights."""


@dataclass(frozen=True)
class AwqScheme:
    group_size: int


_require = partial(refuse_unless, AwqConfigError)


def scheme(quantization_config: Any) -> AwqScheme:
    """The checked scheme of an AWQ quantization_config; refusals name the field."""
    q = quantization_config if isinstance(quantization_config, dict) else {}
    _require(str(q.get("quant_method", "")).lower() == "awq", "quant_method", q.get("quant_method"), "expected awq")
    bits_field = "bits" if "bits" in q or "w_bit" not in q else "w_bit"
    _require(q.get(bits_field) == BITS and not isinstance(q.get(bits_field), bool), bits_field, q.get(bits_field),
             f"supported: {BITS}")
    size_field = "group_size" if "group_size" in q or "q_group_size" not in q else "q_group_size"
    size = q.get(size_field)
    _require(isinstance(size, int) and not isinstance(size, bool) and size > 0, size_field, size,
             "expected a positive integer")
    version = str(q.get("version") or "gemm").lower()
    _require(version in VERSIONS, "version", q.get("version"), f"supported: {', '.join(VERSIONS)}")
    _require(q.get("zero_point", True) is True, "zero_point", q.get("zero_point"), "supported: true")
    return AwqScheme(size)


def weight_shape(parts: dict, module: str, group_size: int) -> tuple[int, int]:
    """(N, K) of the layer whose parts have these shapes, checked against each other."""
    words, zeros, scales = parts[QWEIGHT], parts[QZEROS], parts[SCALES]
    if len(words) != 2 or len(zeros) != 2 or len(scales) != 2:
        raise ShapeMismatch(f"{module}: qweight {list(words)}, qzeros {list(zeros)}, scales {list(scales)}: "
                            f"expected matrices")
    k, n = words[0], words[1] * PER_WORD
    groups = -(-k // group_size)
    if zeros != (groups, words[1]) or scales != (groups, n):
        raise ShapeMismatch(f"{module}: qweight {list(words)}, qzeros {list(zeros)} and scales {list(scales)} do "
                            f"not fit AWQ with group_size {group_size}: expected [K, N/8], [K/{group_size}, N/8] "
                            f"and [K/{group_size}, N]")
    return n, k


def unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, N / 8] -> int64 [R, N]: the values in output order (AWQ_ORDER undone)."""
    slots = unpack_words(words, BITS)                              # [R, N/8, 8]: slot i holds output AWQ_ORDER[i]
    out = torch.empty_like(slots)
    out[..., list(AWQ_ORDER)] = slots
    return out.flatten(1)


def dequantize(parts: dict, module: str, scheme: AwqScheme) -> torch.Tensor:
    """W [N, K] float32 of one layer's AWQ parts."""
    weight_shape({p: tuple(t.shape) for p, t in parts.items()}, module, scheme.group_size)
    q, z = unpack(parts[QWEIGHT]), unpack(parts[QZEROS])           # [K, N], [G, N]
    g = torch.arange(q.shape[0]) // scheme.group_size
    return (parts[SCALES].to(torch.float32)[g] * (q - z[g]).to(torch.float32)).T


class AwqCheckpoint(PackedLinearCheckpoint):
    def __init__(self, ckpt, scheme: AwqScheme):
        super().__init__(ckpt, lambda parts, module: dequantize(parts, module, scheme),
                         lambda parts, module: weight_shape(parts, module, scheme.group_size))


# The loader's interface to a dequantized format (engine/loader.py DEQUANTIZED_FORMATS).
dequantized = AwqCheckpoint
