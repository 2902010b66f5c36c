"""Devices and MoE runners: can this runner execute fused shared-expert slots?"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loadplan.errors import InvalidArgument

DEVICE_KINDS = ("cpu", "cuda", "hip", "musa")

# MoE runners (an engine's, service/rules/engines.py): "torch" is loadplan's own engine,
# portable torch ops on any device; it implements fusion and fused slots under EP (our
# choice, DESIGN 5.2 rule 6). "kernel" is the device vendor's fused MoE kernel; the
# capability thresholds apply.

# Minimum capability for the vendor fused-MoE kernel to run fused shared slots.
FUSED_KERNEL_MIN = {"cuda": (8, 0), "hip": (9, 4), "musa": (3, 1)}
# GLM-4-MoE's fused kernel exists for CUDA and HIP only (DESIGN 5.2: no MUSA).
GLM4_FUSED_KERNEL_MIN = {"cuda": (8, 0), "hip": (9, 4)}
# Devices whose vendor kernel runs fused slots under expert parallelism.
FUSED_UNDER_EP_MIN = {"hip": (9, 4)}

_DEVICE_RE = re.compile(r"^(cpu|cuda|hip|musa)(?::(\d+)\.(\d+))?$")


@dataclass(frozen=True)
class Device:
    kind: str
    capability: tuple[int, int] | None = None

    def __str__(self) -> str:
        if self.capability is None:
            return self.kind
        return f"{self.kind}:{self.capability[0]}.{self.capability[1]}"


def parse_device(text: str, field: str = "runtime.device") -> Device:
    """'cpu', 'cuda:9.0', 'hip:9.4', 'musa:3.1'. Accelerators need a capability."""
    m = _DEVICE_RE.match(text.strip().lower())
    if not m:
        raise InvalidArgument(field, f"{text!r} is not a device; expected cpu or KIND:MAJOR.MINOR "
                                     f"with KIND one of cuda, hip, musa")
    kind, major, minor = m.group(1), m.group(2), m.group(3)
    if kind == "cpu":
        if major is not None:
            raise InvalidArgument(field, "cpu takes no capability")
        return Device("cpu")
    if major is None:
        raise InvalidArgument(field, f"{kind} needs a capability, e.g. {kind}:9.0")
    return Device(kind, (int(major), int(minor)))


def _at_least(device: Device, table: dict[str, tuple[int, int]]) -> bool:
    need = table.get(device.kind)
    return need is not None and device.capability is not None and device.capability >= need


def runs_fused_kernel(runner: str, device: Device,
                      table: dict[str, tuple[int, int]] = FUSED_KERNEL_MIN) -> bool:
    return runner == "torch" or _at_least(device, table)


def runs_fused_slots_under_ep(runner: str, device: Device) -> bool:
    return runner == "torch" or _at_least(device, FUSED_UNDER_EP_MIN)
