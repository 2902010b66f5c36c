"""Rotary position embeddings: default, linear, YaRN, Llama 3's, Hunyuan's NTK-alpha and Phi-3.5-MoE's LongRoPE,
in HF's cos/sin layout.

Numerics follow transformers' rotary classes op for op in float32, so logits match
the reference. Two config spellings exist on the Hub: the older top-level
`rope_theta` + `rope_scaling` (which may be null), and the newer `rope_parameters`
dict; `rope_config_from_hf` reads both into one `RopeConfig`.

The module holds no buffers: the inverse frequencies are a plain tensor computed on
the CPU at construction. The loader builds models on `meta` and then assigns the
checkpoint's tensors; a buffer would stay on `meta` because no checkpoint holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
# What a family that reads NTK-alpha (`rope_config_from_hf(..., ntk_alpha=True)`) supports besides: Hunyuan's
# configs say "dynamic" with an `alpha`, a fixed stretch of the base (no dependence on the sequence length).
NTK_ALPHA_ROPE_TYPES = ("dynamic (with alpha)",)


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    # YaRN only
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # explicit override of the cos/sin scale
    truncate: bool = True
    partial_rotary_factor: float = 1.0
    # Llama 3 (Llama 4 too): wavelengths above original / low_freq_factor divided by `factor`, below
    # original / high_freq_factor kept, smoothly interpolated between
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # NTK-alpha (Hunyuan): the base is theta * alpha ** (d / (d - 2)) for rotary dimension d
    alpha: float = 1.0
    # LongRoPE as Phi-3.5-MoE runs it (`rope_config_from_hf(..., longrope=True)`): each frequency divided by its
    # short factor, cos/sin times `attention_factor` (its short_mscale), for positions below
    # original_max_position_embeddings only (`RotaryEmbedding` refuses the others)
    short_factor: tuple[float, ...] = ()


def rope_config_from_hf(hf_config: Mapping[str, Any], *, partial_rotary_factor: float = 1.0,
                        default_theta: float = 10000.0, ntk_alpha: bool = False, longrope: bool = False) -> RopeConfig:
    """Read either spelling of a HF config.json (a dict) into a RopeConfig. `partial_rotary_factor` and
    `default_theta`: the family's values where the config does not give them (GLM-4-MoE: 0.5; Mixtral: 1e6).
    `ntk_alpha`: the family reads a "dynamic" rope with an `alpha` as NTK-alpha (transformers' Hunyuan does; a
    "dynamic" rope without one, whose frequencies change with the sequence length, stays refused). `longrope`:
    the family reads "longrope" as Phi-3.5-MoE does (transformers' PhimoeRotaryEmbedding: the short factors and
    short_mscale while the sequence stays within original_max_position_embeddings)."""
    params = hf_config.get("rope_parameters")
    scaling = hf_config.get("rope_scaling")
    # HF gives rope_scaling priority when both exist (convert_rope_params_to_dict).
    p: dict[str, Any] = dict(scaling or params or {})
    if "full_attention" in p and isinstance(p["full_attention"], Mapping):
        # rope_parameters nested by layer type; these families use one kind of layer.
        p = dict(p["full_attention"])
    theta = p.get("rope_theta", hf_config.get("rope_theta", default_theta))
    rope_type = p.get("rope_type", p.get("type", "default"))
    partial = p.get("partial_rotary_factor", hf_config.get("partial_rotary_factor")) or partial_rotary_factor
    if ntk_alpha and rope_type == "dynamic" and p.get("alpha"):
        alpha = p["alpha"]
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
            raise ValueError(f"rope alpha must be a number > 0, got {alpha!r}")
        return RopeConfig(rope_type="ntk_alpha", theta=float(theta), alpha=float(alpha),
                          partial_rotary_factor=float(partial))
    if longrope and rope_type == "longrope":
        return _longrope(p, hf_config, float(theta), float(partial))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = SUPPORTED_ROPE_TYPES + (NTK_ALPHA_ROPE_TYPES if ntk_alpha else ()) + (("longrope",) if longrope
                                                                                          else ())
        raise ValueError(f"rope type {rope_type!r} not supported; supported: {', '.join(supported)}")
    if rope_type == "default":
        return RopeConfig(theta=float(theta), partial_rotary_factor=float(partial))
    if rope_type == "linear":
        return RopeConfig(rope_type="linear", theta=float(theta), factor=float(p["factor"]),
                          partial_rotary_factor=float(partial))
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if p.get(k) is None]
        if missing:
            raise ValueError(f"llama3 rope needs {', '.join(missing)} in rope_scaling / rope_parameters")
        return RopeConfig(rope_type="llama3", theta=float(theta), factor=float(p["factor"]),
                          low_freq_factor=float(p["low_freq_factor"]), high_freq_factor=float(p["high_freq_factor"]),
                          original_max_position_embeddings=int(p["original_max_position_embeddings"]),
                          partial_rotary_factor=float(partial))
    max_pos = hf_config.get("max_position_embeddings")
    original = p.get("original_max_position_embeddings") or hf_config.get("original_max_position_embeddings") or max_pos
    if original is None:
        raise ValueError("yarn rope needs original_max_position_embeddings or max_position_embeddings in the config")
    factor = p.get("factor")
    if factor is None:
        # DeepSeek-style: the factor is the ratio of the context lengths (as HF does).
        factor = max_pos / original
    return RopeConfig(
        rope_type="yarn",
        theta=float(theta),
        factor=float(factor),
        original_max_position_embeddings=int(original),
        # HF uses `or`: a 0/None beta falls back to the paper's value.
        beta_fast=float(p.get("beta_fast") or 32),
        beta_slow=float(p.get("beta_slow") or 1),
        mscale=p.get("mscale"),
        mscale_all_dim=p.get("mscale_all_dim"),
        attention_factor=p.get("attention_factor"),
        truncate=bool(p.get("truncate", True)),
        partial_rotary_factor=float(partial),
    )


def _longrope(p: Mapping[str, Any], hf_config: Mapping[str, Any], theta: float, partial: float) -> RopeConfig:
    original = p.get("original_max_position_embeddings") or hf_config.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(f"longrope needs original_max_position_embeddings, a positive integer, got {original!r}")
    factors = {}
    for name in ("short_factor", "long_factor"):
        value = p.get(name)
        if not isinstance(value, list) or not value or \
                any(isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in value):
            raise ValueError(f"longrope {name} must be a list of numbers > 0, got {str(value)[:80]}")
        factors[name] = tuple(float(v) for v in value)
    if len(factors["short_factor"]) != len(factors["long_factor"]):
        raise ValueError("longrope short_factor and long_factor must have the same length")
    mscale = p.get("short_mscale")
    if isinstance(mscale, bool) or not isinstance(mscale, (int, float)):
        raise ValueError(f"longrope short_mscale must be a number, got {mscale!r}")
    return RopeConfig(rope_type="longrope", theta=theta, original_max_position_embeddings=original,
                      short_factor=factors["short_factor"], attention_factor=float(mscale),
                      partial_rotary_factor=partial)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction; DeepSeek squares it (with mscale_all_dim) into the softmax scale."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(head_dim: int, rope: RopeConfig) -> float:
    """DeepSeek's attention scale: head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN."""
    scale = head_dim ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def _inv_freq(dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    cpu = torch.device("cpu")  # explicit: construction may run under a meta device context
    base = rope.theta
    if rope.rope_type == "ntk_alpha":   # transformers' compute_ntk_alpha_rope_parameters
        base = rope.theta * rope.alpha ** (dim / (dim - 2))
    if rope.rope_type == "longrope":    # transformers' _compute_longrope_parameters with its short factors
        if len(rope.short_factor) != dim // 2:
            raise ValueError(f"longrope short_factor has {len(rope.short_factor)} values; the rotary dimension "
                             f"{dim} needs {dim // 2}")
        shape = torch.arange(0, dim, 2, dtype=torch.int64, device=cpu).float() / dim
        factors = torch.tensor(rope.short_factor, dtype=torch.float32, device=cpu)
        return 1.0 / (factors * base ** shape), rope.attention_factor
    if rope.rope_type in ("default", "linear", "llama3", "ntk_alpha"):
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=cpu).to(torch.float) / dim))
        if rope.rope_type == "linear":
            inv = inv / rope.factor
        if rope.rope_type == "llama3":
            inv = _llama3(inv, rope)
        return inv, 1.0

    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    original = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=cpu) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2, device=cpu).to(torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv, float(attention_factor)


def _llama3(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3's frequency scaling (transformers' _compute_llama3_parameters, op for op)."""
    original, factor = rope.original_max_position_embeddings, rope.factor
    low_wavelen, high_wavelen = original / rope.low_freq_factor, original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """positions [T] -> (cos, sin), each [T, rotary_dim]: freqs concatenated twice, times the attention factor."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_position: int):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        self.rope = rope
        self.max_position = max_position
        self.inv_freq, self.attention_factor = _inv_freq(self.rotary_dim, rope)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self.rope
        if rope.rope_type == "longrope" and positions.numel() and int(positions.max()) >= \
                rope.original_max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} is beyond original_max_position_embeddings="
                             f"{rope.original_max_position_embeddings}: the long LongRoPE factors are not supported "
                             f"by the engine")
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, type={self.rope.rope_type}, theta={self.rope.theta}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """Rotate x [..., T, d] by cos/sin [T, d] (broadcast over leading dims).

    interleaved=False: HF's rotate_half on the two halves.
    interleaved=True: DeepSeek's layout, pairs (x0, x1), (x2, x3), ... rotated by one
    frequency each; the output comes out de-interleaved (evens then odds) exactly as
    HF's apply_rotary_pos_emb_interleave returns it, which is what the checkpoints expect
    (q and k get the same permutation, so their dot product is unchanged).
    """
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    if not interleaved:
        return x * cos + _rotate_half(x) * sin
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
