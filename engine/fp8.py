"""Block-quantized FP8 checkpoints (DeepSeek-V3's format), dequantized as they are read.

config.json: `quantization_config = {"quant_method": "fp8", "weight_block_size": [bn, bk], ...}`.
Each quantized linear weight W [N, K] is stored as `X.weight` (float8_e4m3fn) with
`X.weight_scale_inv` (float32 [ceil(N / bn), ceil(K / bk)]), and W = weight * scale_inv
of its block (DeepSeek's `weight_dequant`; "inv": the inverse of the quantization scale).
What a checkpoint leaves unquantized (embeddings, norms, routers, the head) has no scale.

The torch runner computes in plain dtypes, so `Fp8BlockCheckpoint` shows a checkpoint to
the weight remapping (engine/weights.py) as the tensors it stands for: the same names,
each quantized weight dequantized to float32 when it is read, the scales consumed. The
remapping, the fused shared-expert slot and the hard checks at the boundary are then the
same as for any checkpoint. A scale whose weight is missing, a scale of the wrong shape
and an FP8 tensor without a scale are errors naming the tensor. Only static block scales
of the weights are read: with `activation_scheme` "dynamic" (DeepSeek's) activations carry
no stored scales; other schemes are refused by field.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .weights import MissingTensor, ShapeMismatch, UnexpectedTensor

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))


class Fp8ConfigError(ValueError):
    """A quantization_config the engine cannot read as block-quantized FP8 weights."""


def block_size(quantization_config: Any) -> tuple[int, int]:
    """(bn, bk) of an FP8 block-quantized checkpoint's quantization_config, checked."""
    q = quantization_config if isinstance(quantization_config, dict) else {}
    if q.get("quant_method") != "fp8":
        raise Fp8ConfigError(f"config.quantization_config.quant_method: {q.get('quant_method')!r}; the engine reads "
                             f"fp8 weights from a checkpoint quantized with 'fp8' (no online quantization)")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise Fp8ConfigError(f"config.quantization_config.weight_block_size: {block!r}; expected [rows, columns] "
                             f"(per-tensor fp8 scales are not supported)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise Fp8ConfigError(f"config.quantization_config.activation_scheme: {scheme!r} not supported; supported: "
                             f"dynamic")
    return block[0], block[1]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] (fp8) and scale_inv [ceil(N/bn), ceil(K/bk)] -> float32 [N, K]."""
    N, K = weight.shape
    bn, bk = block
    s = scale_inv.to(torch.float32).repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)[:, :K]
    return weight.to(torch.float32) * s


class Fp8BlockCheckpoint:
    """A checkpoint (names / shape / get) whose quantized weights read as float32, their scales hidden."""

    def __init__(self, ckpt, block: tuple[int, int]):
        self.ckpt = ckpt
        self.block = block
        names = ckpt.names()
        held = set(names)
        self._scaled: set[str] = set()
        for name in names:
            if name.endswith(SCALE_SUFFIX):
                weight = name[: -len(SCALE_SUFFIX)]
                if weight not in held:
                    raise MissingTensor(f"{name!r} scales {weight!r}, which is not in the checkpoint")
                self._scaled.add(weight)
        self._names = [n for n in names if not n.endswith(SCALE_SUFFIX)]

    def names(self) -> list[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.ckpt.shape(name))

    def get(self, name: str) -> torch.Tensor:
        tensor = self.ckpt.get(name)
        if name not in self._scaled:
            if tensor.dtype in FP8_DTYPES:
                raise UnexpectedTensor(f"{name!r} is {tensor.dtype} without {name + SCALE_SUFFIX!r}: it cannot be "
                                       f"dequantized")
            return tensor
        scale = self.ckpt.get(name + SCALE_SUFFIX)
        if tensor.dim() not in (2, 3):
            raise ShapeMismatch(f"{name!r} has shape {list(tensor.shape)}; block-quantized weights are matrices, or "
                                f"a stack of them (a layer's experts: [E, N, K])")
        want = (*tensor.shape[:-2], *(math.ceil(n / b) for n, b in zip(tensor.shape[-2:], self.block)))
        if tuple(scale.shape) != want:
            raise ShapeMismatch(f"{name + SCALE_SUFFIX!r} has shape {list(scale.shape)}, expected {list(want)} for "
                                f"{name!r} of shape {list(tensor.shape)} in blocks of {list(self.block)}")
        if tensor.dim() == 3:           # each matrix of the stack in its own blocks (Step-3.5's stacked experts)
            return torch.stack([dequantize(t, s, self.block) for t, s in zip(tensor, scale)])
        return dequantize(tensor, scale, self.block)


# The loader's interface to a dequantized format (engine/loader.py DEQUANTIZED_FORMATS).
scheme = block_size
dequantized = Fp8BlockCheckpoint
