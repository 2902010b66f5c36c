"""Weight-only integer checkpoints in compressed-tensors' `pack-quantized` format, dequantized as read.

This is how Kimi-K2-Thinking and Kimi-K2.5 ship their routed experts (int4, groups of 32;
attention, shared experts and dense MLPs left in bf16 by `ignore`), and how llm-compressor
writes W4A16 / W8A16 checkpoints. config.json:

    quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                           "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
                               "weights": {"type": "int", "num_bits": 4, "symmetric": true,
                                           "strategy": "group", "group_size": 32, "dynamic": false}}},
                           "ignore": ["lm_head", "re:.*self_attn.*", ...]}

Each quantized linear weight W [N, K] of b bits is stored as three tensors:
    X.weight_packed  int32 [N, ceil(K*b / 32)]  the values q + 2^(b-1) packed densely: value k of
                     a row takes bits [k*b, k*b + b) of the row's words, low bits first;
    X.weight_scale   [N, ceil(K / group_size)] (strategy group), [N, 1] (channel), [1] (tensor);
    X.weight_shape   [N, K];
and W = q * scale of its group (symmetric: no zero point). A module in `ignore` keeps a plain
`X.weight`. As with FP8 (engine/fp8.py), `PackedIntCheckpoint` shows the checkpoint to the
weight remapping as the plain tensors it stands for: `X.weight`, dequantized to float32 when
read, its three parts consumed. Only weight-only schemes are read: quantized activations, a KV
cache scheme, transforms, asymmetric weights and activation-ordered groups (`weight_g_idx`)
would change the arithmetic this runner does in plain dtypes, so they are refused by field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .weights import DuplicateTensor, MissingTensor, ShapeMismatch, UnexpectedTensor, refuse_unless

FORMAT = "pack-quantized"
PACKED, SCALE, SHAPE = "weight_packed", "weight_scale", "weight_shape"
# Tensors of schemes the engine refuses in the config; a checkpoint holding them anyway is refused by name.
UNREAD = ("weight_zero_point", "weight_g_idx", "weight_global_scale")
STRATEGIES = ("group", "channel", "tensor")


class CompressedTensorsConfigError(ValueError):
    """A quantization_config the engine cannot read as packed integer weights."""


@dataclass(frozen=True)
class IntWeights:
    """One config group's weight scheme: b-bit symmetric integers, one scale per group / row / tensor."""

    num_bits: int
    strategy: str
    group_size: int | None = None

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        if self.strategy == "group":
            return n, math.ceil(k / self.group_size)
        return (n, 1) if self.strategy == "channel" else (1,)


@dataclass(frozen=True)
class Scheme:
    """The config groups, in config order: (targets, weights)."""

    groups: tuple[tuple[tuple[str, ...], IntWeights], ...]

    def for_module(self, module: str) -> IntWeights:
        """The weights scheme of a quantized module (a checkpoint name without `.weight_packed`)."""
        if len(self.groups) == 1:
            return self.groups[0][1]
        for targets, weights in self.groups:
            if any(_targets(t, module) for t in targets):
                return weights
        raise UnexpectedTensor(f"{module + '.' + PACKED!r} matches none of the config groups' targets "
                               f"{[list(t) for t, _ in self.groups]}: which scheme packed it is unknown")


def _targets(target: str, module: str) -> bool:
    # compressed-tensors' matching: "re:<pattern>" against the module name, else a module name or a class
    # name; every packed tensor belongs to a Linear.
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in ("Linear", module)


_require = partial(refuse_unless, CompressedTensorsConfigError)


def scheme(quantization_config: Any) -> Scheme:
    """The checked scheme of a compressed-tensors quantization_config; refusals name the field."""
    q = quantization_config if isinstance(quantization_config, dict) else {}
    method = str(q.get("quant_method", "")).lower().replace("-", "_")
    _require(method == "compressed_tensors", "quant_method", q.get("quant_method"), "expected compressed-tensors")
    for key in ("kv_cache_scheme", "transform_config"):
        _require(q.get(key) is None, key, q.get(key), "the engine reads weight-only schemes (null)")
    groups = q.get("config_groups")
    _require(isinstance(groups, dict) and groups, "config_groups", groups, "expected a non-empty object")
    out = []
    for name, group in groups.items():
        at = f"config_groups.{name}"
        _require(isinstance(group, dict), at, group, "expected an object")
        fmt = group.get("format") or q.get("format")
        _require(fmt == FORMAT, f"{at}.format" if group.get("format") else "format", fmt, f"supported: {FORMAT}")
        for key in ("input_activations", "output_activations"):
            _require(group.get(key) is None, f"{at}.{key}", group.get(key),
                     "the engine reads weight-only schemes (W4A16, W8A16: null)")
        targets = group.get("targets")
        _require(isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets),
                 f"{at}.targets", targets, "expected a list of module names, class names or re: patterns")
        w = group.get("weights")
        _require(isinstance(w, dict), f"{at}.weights", w, "expected an object")
        _require(w.get("type") == "int", f"{at}.weights.type", w.get("type"), "supported: int")
        bits = w.get("num_bits")
        _require(isinstance(bits, int) and not isinstance(bits, bool) and 1 <= bits <= 8,
                 f"{at}.weights.num_bits", bits, "expected 1 to 8")
        _require(w.get("symmetric") is True, f"{at}.weights.symmetric", w.get("symmetric"),
                 "supported: true (no zero points)")
        _require(not w.get("dynamic"), f"{at}.weights.dynamic", w.get("dynamic"), "supported: false")
        _require(w.get("actorder") in (None, "static", "weight"), f"{at}.weights.actorder", w.get("actorder"),
                 "supported: null, static, weight (activation-ordered groups need weight_g_idx)")
        strategy = w.get("strategy")
        _require(strategy in STRATEGIES, f"{at}.weights.strategy", strategy, f"supported: {', '.join(STRATEGIES)}")
        size = w.get("group_size")
        if strategy == "group":
            _require(isinstance(size, int) and not isinstance(size, bool) and size > 0,
                     f"{at}.weights.group_size", size, "expected a positive integer for strategy group")
        out.append((tuple(targets), IntWeights(bits, strategy, size if strategy == "group" else None)))
    return Scheme(tuple(out))


def unpack(packed: torch.Tensor, num_bits: int, k: int) -> torch.Tensor:
    """int32 [N, ceil(k*b/32)] -> the signed values int8 [N, k] (value j at bits [j*b, j*b + b))."""
    words = packed.to(torch.int64) & 0xFFFFFFFF                     # the words as unsigned
    bit = torch.arange(k, dtype=torch.int64) * num_bits
    word, offset = bit // 32, bit % 32
    low = words[:, word] >> offset
    # A value that runs past its word continues in the next one (3, 5, 6, 7 bits).
    spill = offset + num_bits > 32
    high = words[:, (word + 1).clamp(max=words.shape[1] - 1)] << (32 - offset)
    value = torch.where(spill, low | high, low) & ((1 << num_bits) - 1)
    return (value - (1 << (num_bits - 1))).to(torch.int8)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], weights: IntWeights) -> torch.Tensor:
    """W [N, K] float32 from its packed values and scales (shapes checked by the caller)."""
    n, k = shape
    q = unpack(packed, weights.num_bits, k).to(torch.float32)
    s = scale.to(torch.float32)
    if weights.strategy == "group":
        s = s.repeat_interleave(weights.group_size, dim=1)[:, :k]
    elif weights.strategy == "tensor":
        s = s.reshape(1, 1)
    return q * s


class PackedIntCheckpoint:
    """A checkpoint (names / shape / get) whose packed weights read as float32 `X.weight`, their parts hidden."""

    def __init__(self, ckpt, scheme: Scheme):
        self.ckpt = ckpt
        self.scheme = scheme
        names = ckpt.names()
        held = set(names)
        self._packed: dict[str, str] = {}          # X.weight -> X (the module)
        for name in names:
            module, _, leaf = name.rpartition(".")
            if leaf in UNREAD:
                raise UnexpectedTensor(f"{name!r}: a tensor of a scheme the engine does not read (asymmetric or "
                                       f"activation-ordered weights); the config should have been refused")
            if leaf in (SCALE, SHAPE) and f"{module}.{PACKED}" not in held:
                raise MissingTensor(f"{name!r} belongs to {module + '.' + PACKED!r}, which is not in the checkpoint")
            if leaf == PACKED:
                for part in (SCALE, SHAPE):
                    if f"{module}.{part}" not in held:
                        raise MissingTensor(f"{module + '.' + part!r} is missing: {name!r} cannot be dequantized")
                if f"{module}.weight" in held:
                    raise DuplicateTensor(f"{module + '.weight'!r} is in the checkpoint both plain and packed")
                self._packed[f"{module}.weight"] = module
        self._names = [f"{n.rpartition('.')[0]}.weight" if n.endswith("." + PACKED) else n for n in names
                       if not (n.endswith("." + SCALE) or n.endswith("." + SHAPE))]

    def names(self) -> list[str]:
        return self._names

    def _shape(self, module: str) -> tuple[int, int]:
        shape = self.ckpt.get(f"{module}.{SHAPE}")
        if shape.numel() != 2:
            raise ShapeMismatch(f"{module + '.' + SHAPE!r} is {shape.tolist()}; packed weights are matrices [N, K]")
        n, k = (int(v) for v in shape.tolist())
        return n, k

    def shape(self, name: str) -> tuple[int, ...]:
        module = self._packed.get(name)
        return tuple(self.ckpt.shape(name)) if module is None else self._shape(module)

    def get(self, name: str) -> torch.Tensor:
        module = self._packed.get(name)
        if module is None:
            return self.ckpt.get(name)
        weights = self.scheme.for_module(module)
        n, k = self._shape(module)
        packed = self.ckpt.get(f"{module}.{PACKED}")
        want = (n, math.ceil(k * weights.num_bits / 32))
        if packed.dtype != torch.int32 or tuple(packed.shape) != want:
            raise ShapeMismatch(f"{module + '.' + PACKED!r} is {packed.dtype} {list(packed.shape)}, expected "
                                f"torch.int32 {list(want)} for {weights.num_bits}-bit values of shape [{n}, {k}]")
        scale = self.ckpt.get(f"{module}.{SCALE}")
        want_scale = weights.scale_shape(n, k)
        if tuple(scale.shape) != want_scale and not (weights.strategy == "tensor" and scale.numel() == 1):
            raise ShapeMismatch(f"{module + '.' + SCALE!r} has shape {list(scale.shape)}, expected "
                                f"{list(want_scale)} for strategy {weights.strategy} over [{n}, {k}]")
        return dequantize(packed, scale, (n, k), weights)


# The loader's interface to a dequantized format (engine/loader.py DEQUANTIZED_FORMATS).
dequantized = PackedIntCheckpoint
