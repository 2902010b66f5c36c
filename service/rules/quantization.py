"""Quantization as the gates see it: a name, and what the config excludes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# Formats whose fused MoE kernels cannot carry a fused shared slot (DESIGN 5.2 rule 8).
NO_FUSION_QUANTIZATIONS = ("w4afp8", "wint4afp8", "wint4a16")


@dataclass(frozen=True)
class Quantization:
    name: str | None                      # None: unquantized
    excluded_modules: tuple[str, ...] = field(default=())

    def excludes(self, fragment: str) -> bool:
        return any(fragment in m for m in self.excluded_modules)


def quantization_of(explicit: str | None, qconfig: Mapping[str, Any] | None) -> Quantization:
    """The explicit name wins over the config's `quant_method`; names are lower-case."""
    qconfig = qconfig or {}
    name = explicit or qconfig.get("quant_method") or None
    if isinstance(name, str):
        name = name.strip().lower().replace("-", "_") or None
        if name == "modelopt":
            name = _modelopt_name(qconfig)
    excluded: list[str] = []
    for key in ("exclude_modules", "exclude", "ignore", "modules_to_not_convert", "ignored_layers"):   # exclude: Quark
        value = qconfig.get(key)
        if isinstance(value, list):
            excluded.extend(str(v) for v in value)
    return Quantization(name if isinstance(name, str) else None, tuple(excluded))


def _modelopt_name(qconfig: Mapping[str, Any]) -> str:
    """ModelOpt writes its format in quant_algo; the name its config's format has (SGLang 0.5.23's
    configs/model_config.py: _parse_modelopt_quant_config): a mixed-precision checkpoint with NVFP4 layers is
    modelopt_mixed, one without is w4afp8."""
    algo = str(qconfig.get("quant_algo", "")).upper()
    if algo == "MIXED_PRECISION":
        layers = qconfig.get("quantized_layers")
        algos = {str(v.get("quant_algo", "")).upper() for v in layers.values() if isinstance(v, dict)} \
            if isinstance(layers, dict) else set()
        return "modelopt_mixed" if algos & {"NVFP4", "W4A16_NVFP4"} else "w4afp8"
    if "FP4" in algo:
        return "modelopt_fp4"
    if algo == "FP8":
        return "modelopt_fp8"
    if algo == "MXFP8":
        return "mxfp8"
    return "modelopt"
