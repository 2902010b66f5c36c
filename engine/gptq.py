"""GPTQ checkpoints (AutoGPTQ's and GPTQModel's `quant_method: gptq`), dequantized as they are read.

config.json: `quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false,
"sym": true, "checkpoint_format": "gptq"}`. Each quantized linear layer X of weight W [N, K] is stored as
engine/packed_linear.py describes, GPTQ's way:
- `qweight` int32 [K * b / 32, N]: packed along the inputs, input k in word k // (32/b), at bits
  b * (k % (32/b)) of it;
- `qzeros` int32 [G, N * b / 32]: packed along the outputs alike. The format "gptq" (v1, what most Hub
  checkpoints are) stores each zero point minus one, wrapped to b bits (AutoGPTQ adds the one back when it
  dequantizes); "gptq_v2" stores it as it is;
- `scales` [G, N]; `g_idx` int32 [K], each input's group (with `desc_act` the groups follow the activation
  order, not k // group_size).
Bits 2, 4 and 8 (3-bit values straddle words: refused), group_size -1 (one group a row) or positive. What the
quantizer left unquantized (embeddings, the routers, the head) is read as it is. GPTQModel's per-module
overrides (`dynamic`), other checkpoint formats (marlin, bitblas; GPTQModel spells the field `format`) and
words other than int32 (`pack_dtype`) are refused by field.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .packed_linear import G_IDX, QWEIGHT, QZEROS, SCALES, PackedLinearCheckpoint, unpack_words
from .weights import ShapeMismatch, refuse_unless

BITS = (2, 4, 8)
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}      # -> what is added to a stored zero point


class GptqConfigError(ValueError):
    """A quantization_config the engine cannot read as GPTQ weights."""


@dataclass(frozen=True)
class GptqScheme:
    bits: int
    group_size: int          # -1: one group per row
    zero_offset: int         # 1 for checkpoint_format gptq (zero points stored minus one), 0 for gptq_v2


_require = partial(refuse_unless, GptqConfigError)


def scheme(quantization_config: Any) -> GptqScheme:
    """The checked scheme of a GPTQ quantization_config; refusals name the field."""
    q = quantization_config if isinstance(quantization_config, dict) else {}
    _require(str(q.get("quant_method", "")).lower() == "gptq", "quant_method", q.get("quant_method"), "expected gptq")
    bits = q.get("bits")
    _require(bits in BITS and not isinstance(bits, bool), "bits", bits, f"supported: {', '.join(map(str, BITS))}")
    size = q.get("group_size", -1)
    _require(isinstance(size, int) and not isinstance(size, bool) and (size == -1 or size > 0), "group_size", size,
             "expected -1 (one group per row) or a positive integer")
    # GPTQModel writes the format as `format` (AutoGPTQ as `checkpoint_format`), and may pack into other words.
    fmt_field = "checkpoint_format" if q.get("checkpoint_format") or not q.get("format") else "format"
    fmt = str(q.get(fmt_field) or "gptq").lower()
    _require(fmt in CHECKPOINT_FORMATS, fmt_field, q.get(fmt_field), f"supported: {', '.join(CHECKPOINT_FORMATS)}")
    _require(q.get("pack_dtype", "int32") in ("int32", "torch.int32"), "pack_dtype", q.get("pack_dtype"),
             "supported: int32")
    _require(not q.get("dynamic"), "dynamic", q.get("dynamic"), "per-module overrides are not read (null or {})")
    return GptqScheme(bits, size, CHECKPOINT_FORMATS[fmt])


def weight_shape(parts: dict, module: str, bits: int) -> tuple[int, int]:
    """(N, K) of the layer whose parts have these shapes, checked against each other."""
    words, zeros, scales = parts[QWEIGHT], parts[QZEROS], parts[SCALES]
    per = 32 // bits
    if len(words) != 2 or len(zeros) != 2 or len(scales) != 2:
        raise ShapeMismatch(f"{module}: qweight {list(words)}, qzeros {list(zeros)}, scales {list(scales)}: "
                            f"expected matrices")
    k, n = words[0] * per, words[1]
    if scales[1] != n or zeros != (scales[0], n // per) or n % per:
        raise ShapeMismatch(f"{module}: qweight {list(words)}, qzeros {list(zeros)} and scales {list(scales)} do "
                            f"not fit {bits}-bit GPTQ: expected [K*{bits}/32, N], [G, N*{bits}/32] and [G, N]")
    if G_IDX in parts and parts[G_IDX] != (k,):
        raise ShapeMismatch(f"{module + '.' + G_IDX!r} has shape {list(parts[G_IDX])}, expected [{k}]")
    return n, k


def dequantize(parts: dict, module: str, scheme: GptqScheme) -> torch.Tensor:
    """W [N, K] float32 of one layer's GPTQ parts."""
    bits, mask = scheme.bits, (1 << scheme.bits) - 1
    n, k = weight_shape({p: tuple(t.shape) for p, t in parts.items()}, module, bits)
    q = unpack_words(parts[QWEIGHT].T, bits).reshape(n, k)                     # [N, K]: input k of word k // per
    z = (unpack_words(parts[QZEROS], bits).flatten(1) + scheme.zero_offset) & mask   # [G, N]
    scales = parts[SCALES].to(torch.float32)                                  # [G, N]
    groups = scales.shape[0]
    if G_IDX in parts:
        g = parts[G_IDX].to(torch.int64)
        if g.numel() and (g.min() < 0 or g.max() >= groups):
            raise ShapeMismatch(f"{module + '.' + G_IDX!r} names groups {int(g.min())}..{int(g.max())}; the layer "
                                f"has {groups}")
    else:
        size = k if scheme.group_size == -1 else scheme.group_size
        g = torch.arange(k) // size
        if int(g[-1]) >= groups:
            raise ShapeMismatch(f"{module + '.' + SCALES!r} has {groups} groups; {k} inputs in groups of {size} "
                                f"need {int(g[-1]) + 1}")
    return scales.T[:, g] * (q - z.T[:, g]).to(torch.float32)


class GptqCheckpoint(PackedLinearCheckpoint):
    def __init__(self, ckpt, scheme: GptqScheme):
        super().__init__(ckpt, lambda parts, module: dequantize(parts, module, scheme),
                         lambda parts, module: weight_shape(parts, module, scheme.bits), optional=(G_IDX,))


# The loader's interface to a dequantized format (engine/loader.py DEQUANTIZED_FORMATS).
dequantized = GptqCheckpoint
