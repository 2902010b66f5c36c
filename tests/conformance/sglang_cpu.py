"""Make SGLang 0.5.23's decision code importable on a CPU, with a device emulated.

Run only under the SGLang environment's python (`.venv-sglang`, made by `make sglang-env`),
never under the project's: it replaces pieces of torch's CUDA API process-wide.

DESIGN 8.4: SGLang imports triton, torchvision and tvm_ffi unconditionally; none has a
CPU build here, so each is a catch-all stub (triton's `runtime.driver.active` raises, as
it does on a machine without a GPU). The device is emulated below torch: before SGLang is
imported, `torch.cuda.is_available`, `torch.version.cuda`/`hip` and the capability and
properties queries answer for the requested device, so every `_is_cuda = is_cuda()` and
`lru_cache`d sm/gfx check that SGLang evaluates at import time caches the emulated
device, exactly as on that machine. One process emulates one device: `emulate(device)`
must run before the first `import sglang`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from dataclasses import dataclass

SGLANG_VERSION = "0.5.23"

# name -> (platform, capability, what the properties report)
DEVICES = {
    "cuda:8.0": ("cuda", (8, 0), "NVIDIA A100-SXM4-80GB", ""),
    "cuda:9.0": ("cuda", (9, 0), "NVIDIA H100 80GB HBM3", ""),
    "cuda:10.0": ("cuda", (10, 0), "NVIDIA B200", ""),
    "hip:9.4": ("hip", (9, 4), "AMD Instinct MI300X", "gfx942:sramecc+:xnack-"),
    "hip:9.5": ("hip", (9, 5), "AMD Instinct MI355X", "gfx950:sramecc+:xnack-"),
}


class _Anything:
    """Stands for any attribute of a stubbed GPU-only module; never does GPU work."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Anything(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        # As a decorator (`@triton.jit`, `@triton.autotune(...)`), hand the function back.
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _Anything(f"{self._name}()")

    def __getitem__(self, item):
        return _Anything(f"{self._name}[]")

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self):
        return f"<stub {self._name}>"


@dataclass(frozen=True)
class _Target:
    backend: str
    arch: object
    warp_size: int


class _ActiveDriver(_Anything):
    """triton.runtime.driver.active: the target of the emulated device (set by emulate)."""

    target = _Target("cuda", 90, 32)
    properties: dict = {}

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    @property
    def utils(self):
        driver = self

        class _Utils(_Anything):
            def get_device_properties(self, device=0):
                return dict(driver.properties)

        return _Utils("triton.runtime.driver.active.utils")


class _Driver:
    active = _ActiveDriver("triton.runtime.driver.active")


class _Constexpr:
    """triton.language.constexpr: a value a kernel module computes its constants from (`.value`)."""

    def __init__(self, value=None):
        self.value = value.value if isinstance(value, _Constexpr) else value

    def __repr__(self) -> str:
        return f"constexpr[{self.value!r}]"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = _Anything(f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = VERSIONS.get(spec.name.split(".")[0], "0.0.0")
        return module

    def exec_module(self, module):
        if module.__name__ == "triton":
            module.runtime = importlib.import_module("triton.runtime")
        if module.__name__ == "triton.runtime":
            module.driver = _Driver()
        if module.__name__ == "triton.language":   # module-level constants some kernels compute with at import
            module.constexpr = _Constexpr
        if module.__name__ == "xgrammar":       # a type pydantic's request models are built with
            import typing
            module.StructuralTag = typing.Any


class _StubFinder(importlib.abc.MetaPathFinder):
    def __init__(self, roots: tuple[str, ...]):
        self.roots = roots

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


# GPU-only wheels. triton, torchvision and tvm_ffi are imported unconditionally; the
# others are SGLang's GPU dependencies (sglang-kernel, flashinfer-python, sgl-deep-gemm,
# sgl-deep-ep, nvidia-cutlass-dsl; aiter on ROCm): a GPU host has them installed, so they
# are present here too (as stubs), and SGLang's availability probes answer as they would there.
# xgrammar (structured output, no load-time decision) is stubbed too: SGLang 0.5.20's server_args imports it through
# its function-call parser, and its wheel needs tvm_ffi's compiled runtime.
STUBBED = ("triton", "torchvision", "tvm_ffi", "sgl_kernel", "flashinfer", "deep_gemm",
           "deep_ep", "cutlass", "aiter", "xgrammar")
VERSIONS = {"triton": "3.5.0", "flashinfer": "0.7.2", "sgl_kernel": "0.4.10",
            "deep_gemm": "0.2.3", "deep_ep": "0.1.2", "torchvision": "0.28.0", "cutlass": "4.8.0"}


@dataclass(frozen=True)
class _Props:
    name: str
    gcnArchName: str
    major: int
    minor: int
    multi_processor_count: int = 132
    total_memory: int = 80 * 1024**3
    warp_size: int = 32


def emulate(device: str) -> None:
    """Stub the GPU-only modules and make torch report `device` (one of DEVICES)."""
    if device not in DEVICES:
        raise ValueError(f"device: {device!r} is not one of {sorted(DEVICES)}")
    if "sglang" in sys.modules:
        raise RuntimeError("emulate() must run before sglang is imported")
    sys.meta_path.insert(0, _StubFinder(STUBBED))

    import torch

    platform, capability, name, gcn = DEVICES[device]
    props = _Props(name=name, gcnArchName=gcn, major=capability[0], minor=capability[1],
                   warp_size=64 if platform == "hip" else 32)
    # SGLang never compiles anything on the decision path; compiling needs a GPU toolchain.
    torch.compile = lambda fn=None, *a, **k: fn if callable(fn) else (lambda f: f)
    torch.version.cuda = "12.8" if platform == "cuda" else None
    torch.version.hip = "6.3.42131" if platform == "hip" else None
    torch.cuda.is_available = lambda: True
    torch.cuda.is_initialized = lambda: True     # read the capability from torch, not NVML
    torch.cuda.device_count = lambda: 8
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: capability
    torch.cuda.get_device_properties = lambda device=None: props
    torch.cuda.get_device_name = lambda device=None: name
    torch.cuda.mem_get_info = lambda device=None: (props.total_memory, props.total_memory)

    _ActiveDriver.target = _Target(platform, gcn.split(":")[0] if gcn else capability[0] * 10 + capability[1],
                                   props.warp_size)
    _ActiveDriver.properties = {"multiprocessor_count": props.multi_processor_count,
                                "max_shared_mem": 232448, "max_num_regs": 65536,
                                "warpSize": props.warp_size}

    # ROCm's memory size comes from running rocminfo, which this host lacks.
    common = importlib.import_module("sglang.srt.utils.common")
    common.get_amdgpu_memory_capacity = lambda: props.total_memory / 1024**2


def sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")
