"""MXFP4 checkpoints (how gpt-oss ships its experts), dequantized as they are read.

config.json: `quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}`.
A quantized tensor X of shape [E, K, N] (transformers' stacked experts: `gate_up_proj`
[E, D, 2I], `down_proj` [E, I, D]) is stored transposed and packed, in blocks of 32
values along K (the OCP microscaling format):
- `X_blocks` uint8 [E, N, K / 32, 16]: two FP4 (E2M1) codes a byte, the low nibble the
  even element; a code is sign | exponent (2 bits) | mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6
  and their negatives (`FP4_VALUES`);
- `X_scales` uint8 [E, N, K / 32]: each block's power of two, E8M0 biased by 127.
X = (FP4 value * 2^(scale - 127)), reshaped [E, N, K] and transposed to [E, K, N]: what
transformers' `convert_moe_packed_tensors` makes of them (the tests read it against that
function). What the checkpoint leaves unquantized (attention, router, embeddings, head,
the experts' biases) is read as it is.

`Mxfp4Checkpoint` shows the checkpoint to the loader with each `X_blocks` / `X_scales`
pair as the one float32 tensor `X` it stands for (gpt-oss's `StackedExperts` then shows
that one expert at a time). A blocks tensor without its scales, scales without blocks, or
shapes that do not fit each other are errors naming the tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from .weights import DuplicateTensor, MissingTensor, ShapeMismatch

BLOCKS, SCALES = "_blocks", "_scales"
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32                     # values per scale
SCALE_BIAS = 127


class Mxfp4ConfigError(ValueError):
    """A quantization_config the engine cannot read as MXFP4 weights."""


def scheme(quantization_config: Any) -> tuple[str, ...]:
    """The modules the checkpoint leaves unquantized (only for the record: which tensors are packed is read off
    the checkpoint's own names), the config checked."""
    q = quantization_config if isinstance(quantization_config, dict) else {}
    if q.get("quant_method") != "mxfp4":
        raise Mxfp4ConfigError(f"config.quantization_config.quant_method: {q.get('quant_method')!r}; expected "
                               f"'mxfp4'")
    skipped = q.get("modules_to_not_convert", [])
    if skipped is None:
        skipped = []
    if not (isinstance(skipped, list) and all(isinstance(m, str) for m in skipped)):
        raise Mxfp4ConfigError(f"config.quantization_config.modules_to_not_convert: {skipped!r}; expected a list of "
                               f"module names")
    return tuple(skipped)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., N, G, 16], scales uint8 [..., N, G] -> float32 [..., G * 32, N] (K = G * 32 first)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)   # [..., N, G, 16, 2]
    values = values.flatten(-2)                                                             # [..., N, G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS)[..., None])
    return values.flatten(-2).transpose(-1, -2)                                            # [..., K, N]


class Mxfp4Checkpoint:
    """A checkpoint (names / shape / get) whose `X_blocks` + `X_scales` pairs read as float32 `X`."""

    def __init__(self, ckpt, skipped: tuple[str, ...] = ()):
        self.ckpt = ckpt
        self.skipped = skipped
        names = ckpt.names()
        held = set(names)
        self._packed: dict[str, tuple[int, ...]] = {}        # X -> its dequantized shape
        for name in names:
            if name.endswith(SCALES) and name[: -len(SCALES)] + BLOCKS not in held:
                raise MissingTensor(f"{name!r} scales {name[: -len(SCALES)] + BLOCKS!r}, which is not in the "
                                    f"checkpoint")
            if not name.endswith(BLOCKS):
                continue
            base = name[: -len(BLOCKS)]
            if base + SCALES not in held:
                raise MissingTensor(f"{name!r} has no {base + SCALES!r}: it cannot be dequantized")
            b, s = tuple(ckpt.shape(name)), tuple(ckpt.shape(base + SCALES))
            if len(b) < 3 or b[-1] != BLOCK // 2 or b[:-1] != s:
                raise ShapeMismatch(f"{name!r} of shape {list(b)} and {base + SCALES!r} of shape {list(s)} do not "
                                    f"fit: expected [..., N, G, {BLOCK // 2}] and [..., N, G]")
            if base in held:
                raise DuplicateTensor(f"{base!r} is in the checkpoint both plain and as {name!r}")
            self._packed[base] = (*b[:-3], b[-2] * BLOCK, b[-3])
        self._names = [n for n in names if not n.endswith((BLOCKS, SCALES))] + list(self._packed)

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._packed[name] if name in self._packed else tuple(self.ckpt.shape(name))

    def get(self, name: str) -> torch.Tensor:
        if name not in self._packed:
            return self.ckpt.get(name)
        return dequantize(self.ckpt.get(name + BLOCKS), self.ckpt.get(name + SCALES))


# The loader's interface to a dequantized format (engine/loader.py DEQUANTIZED_FORMATS).
dequantized = Mxfp4Checkpoint
