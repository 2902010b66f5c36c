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
        algo = str(qconfig.get("quant_algo", "")).lower()
        if name == "modelopt" and "fp4" in algo:
            name = "modelopt_fp4"  # ModelOpt writes the format in quant_algo
    excluded: list[str] = []
    for key in ("exclude_modules", "exclude", "ignore", "modules_to_not_convert", "ignored_layers"):   # exclude: Quark
        value = qconfig.get(key)
        if isinstance(value, list):
            excluded.extend(str(v) for v in value)
    return Quantization(name if isinstance(name, str) else None, tuple(excluded))
