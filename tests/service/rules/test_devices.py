"""Device strings, MoE runners, and which of them run fused shared slots (DESIGN 5.2 rules 6-7)."""

from __future__ import annotations

import pytest

from loadplan.errors import InvalidArgument
from loadplan.service.rules.devices import (Device, parse_device, runs_fused_kernel,
                                            runs_fused_slots_under_ep)


@pytest.mark.parametrize("text,kind,cap", [
    ("cpu", "cpu", None),
    ("cuda:9.0", "cuda", (9, 0)),
    ("cuda:10.0", "cuda", (10, 0)),
    ("hip:9.4", "hip", (9, 4)),
    ("musa:3.1", "musa", (3, 1)),
    (" CUDA:8.6 ", "cuda", (8, 6)),
])
def test_parse_device(text, kind, cap):
    dev = parse_device(text)
    assert dev == Device(kind, cap)
    assert parse_device(str(dev)) == dev


@pytest.mark.parametrize("text", ["", "gpu", "cuda", "cuda:9", "cuda:9.0.1", "cpu:1.0", "hip:x.y",
                                  "cuda:-1.0", "npu:1.0", "cuda 9.0", "cuda:9.0;cpu", "tpu:4.0"])
def test_bad_device_strings_name_the_field(text):
    with pytest.raises(InvalidArgument) as e:
        parse_device(text)
    assert e.value.field == "runtime.device"
    assert str(e.value).startswith("runtime.device:")


@pytest.mark.parametrize("dev,fused", [
    ("cuda:7.0", False), ("cuda:7.9", False), ("cuda:8.0", True), ("cuda:9.0", True), ("cuda:12.0", True),
    ("hip:9.3", False), ("hip:9.4", True), ("hip:9.5", True), ("hip:10.0", True),
    ("musa:3.0", False), ("musa:3.1", True), ("musa:4.0", True), ("musa:2.9", False),
])
def test_vendor_kernel_thresholds(dev, fused):
    assert runs_fused_kernel("kernel", parse_device(dev)) is fused


@pytest.mark.parametrize("dev,under_ep", [
    ("cuda:8.0", False), ("cuda:12.0", False), ("musa:3.1", False), ("hip:9.3", False), ("hip:9.4", True),
])
def test_vendor_kernel_under_ep(dev, under_ep):
    assert runs_fused_slots_under_ep("kernel", parse_device(dev)) is under_ep


@pytest.mark.parametrize("dev", ["cpu", "cuda:7.0", "hip:9.0", "musa:1.0"])
def test_torch_runner_always_fuses_and_runs_slots_under_ep(dev):
    """Our choice (DESIGN 5.2 rule 6): loadplan's own torch runner implements fusion everywhere."""
    assert runs_fused_kernel("torch", parse_device(dev))
    assert runs_fused_slots_under_ep("torch", parse_device(dev))
