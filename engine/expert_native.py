"""A compiled kernel for the routed experts: the whole expert MLP per (expert, rows) span in C++.

It is one of the experts implementations engine/expert_choice.py measures on the machine at hand; the
figures below are from where it was tuned and hold only there (issue 34: on another CPU its decode was
slower than torch's own paths, hence the measured choice).

Why (measured on 2 cores, D=1024, I=256, fp32; figures in engine/expert_kernel.py): per expert,
torch's matmuls (MKL) leave time on the table at every row count m:
- m <= 4 (decode, small batches): a few matrix-vector products over 3 MB of weights from memory.
  The BLAS treats [m, 1024] x [1024, 512] as a small GEMM: per call it packs the weight, and its
  matrix-vector loops run at about the speed of memory from the cache, so reading an expert and
  computing with it do not overlap (~480 us per expert and core at m~2 where memory alone takes
  ~260 us). The dot products here (`proj`) stream each weight row once (4 rows of W x up to 4 rows
  of x in registers) with a software prefetch (prefetcht0) 16 KiB ahead. (With prefetchnta, as first
  tuned elsewhere, a 2-core Sapphire Rapids VM streamed at a quarter of its speed: SMALL_PF_LOC in
  expert_native.cpp.)
- m > 4 (prefill; ~64 rows per expert at T=512): the BLAS packs the 2 MB weight per call for only
  m rows and cannot prefetch the next expert, so ~0.4 ms of each expert's ~1.5 ms per core waits
  on memory (45-72 GFLOP/s per core at m=17-100 in this loop). The tiles here (`projT`) transpose
  the expert's rows once (xt [D, m], 16 x 16 blocks in registers) and broadcast one weight at a
  time against 3 vectors of 16 rows: 8 rows of W x 48 rows of x = 24 accumulators, every weight
  read once from memory (the next 8 rows prefetched while these compute), the rows from L2. No
  packing, no horizontal sums: ~98-104 GFLOP/s per core at m >= 64 from memory, where MKL's
  dense [4096, 1024] x [1024, 768] reaches 91-95 on one core. Rows are padded to 8 (a half
  vector), not 16. Above 96 rows an expert is split into work items of whole blocks of 16 rows.
Both fuse silu(gate) * up * routing weight, and hand items to torch's own OpenMP threads one at a
time (the library resolves libgomp.so.1 to the one torch loaded), so no Python thread has to be
woken while torch's OpenMP workers still spin after the previous op. With index maps the kernel
reads each row straight from the token's row of x and writes it to its (token, k) row: no gathered
copy, no index_add.

Single core, 64 experts from memory (192 MB), ms, this kernel vs torch's per-expert matmuls, the
same run (min of 4): m=1 14.2 vs 18.8, m=4 15.7 vs 28.6, m=8 14.4 vs 32.2, m=17 26.6 vs 44.0,
m=64 65.7 vs 93.2 (98 vs 69 GFLOP/s), m=100 103 vs 132, m=200 202 vs 233, m=512 494 vs 571
(104 vs 90 GFLOP/s). Max abs difference to torch's fp32 ~4e-6 on outputs of magnitude ~1.

The tiles above need AVX-512's 32 vector registers of 16 floats; built for AVX2 (16 registers of 8) the kernel
has its own (issue 53, measured on a 2-core AMD EPYC 7003 VM: AVX2 and FMA, no AVX-512):
- dot products written in AVX2 intrinsics for up to 8 rows per expert (4 rows of W x 1 row of x, 2 x 2, 2 x 3,
  2 x 4), which read the weights at about the speed of memory (one core, 8 experts from memory: 13-18 GB/s at
  1-4 rows, where the vector extension's 16-wide code above read float32 at 11 and bfloat16 at 6; vLLM's kernel
  on the same core read 23 float32 and 14 bfloat16);
- transposed tiles of 4 rows of W x 3 vectors of 8 rows of x (`tile8`) from 9 rows on.

bfloat16 (issue 53): the weights and x stay bfloat16 and every sum is float32 (out rows are float32; the caller
sums a token's rows and rounds once). The dot products widen 16 weights at a time (AVX2: one unpack per 8, with
x's rows permuted to the widened order); the tiles widen one block of weight rows into a float32 scratch (L1)
and reuse the float32 tiles. On a CPU with AVX-512 BF16 (checked at run time with __builtin_cpu_supports, and
then against the widening dot products on a small product: a wrong result turns them off) the dot products
use `_mm512_dpbf16_ps` on bfloat16 x and activations (LOADPLAN_EXPERTS_NO_DPBF16=1 turns that off);
`features()` says which paths the build has.

It is built on first use by torch.utils.cpp_extension from expert_native.cpp (kept next to this file
and shipped as package data; -O3 -march=native: it is compiled on the machine that runs it) into a
per-user cache directory keyed by the source, the flags, the CPU's feature flags and torch's version
(~20-40 s once; later processes find it built). It registers the operators torch.ops.loadplan_experts.spans
and max_rows. Without a compiler or ninja, or if the build or load fails, `library()` says so once (a
logged warning naming the reason) and for all, and engine/expert_choice.py picks the fastest measured
implementation among the others.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CPP = Path(__file__).with_name("expert_native.cpp")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno"]
_LOCK = threading.Lock()
_OPS = None                    # torch.ops.loadplan_experts once loaded
_TRIED = False
_REASON = ""                   # why there is no kernel, once tried and failed


def cpu_key() -> str:
    """What a build (and a measured choice) is valid for: this CPU's feature flags and torch's version."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        pass
    flags = flags or platform.processor() or platform.machine()
    return hashlib.sha256(f"{flags}\0{torch.__version__}".encode()).hexdigest()[:16]


def source_key() -> str:
    """The kernel's source, hashed: measured choices (engine/expert_choice.py) are valid for one version of it (a
    kernel that computes more, e.g. bfloat16, or faster, is measured again)."""
    try:
        return hashlib.sha256(CPP.read_bytes()).hexdigest()[:12]
    except OSError:
        return "none"


def cache_dir() -> Path:
    """Per-user cache of the built kernel and of the measured choices (engine/expert_choice.py);
    LOADPLAN_CACHE_DIR overrides it."""
    base = os.environ.get("LOADPLAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "loadplan")
    for d in (Path(base), Path(tempfile.gettempdir()) / f"loadplan-{os.getuid()}"):
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise OSError("no writable cache directory for the expert kernel")


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH: the ninja package's binary (the engine extra installs it) counts
    too when the venv is not activated."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build():
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or "c++"
    if not shutil.which(cxx):
        raise OSError(f"no C++ compiler ({cxx!r} not on PATH)")
    _ninja_on_path()
    if not cpp_extension.is_ninja_available():
        raise OSError("ninja is not installed (the engine extra installs it)")
    source = CPP.read_bytes()
    errors = []
    for omp in (["-fopenmp"], []):                             # without OpenMP: one thread
        flags = _FLAGS + omp
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), cpu_key().encode()])).hexdigest()[:16]
        build = cache_dir() / f"expert_native_{key}"
        build.mkdir(exist_ok=True)
        try:
            cpp_extension.load(name=f"loadplan_expert_native_{key}", sources=[str(CPP)], extra_cflags=flags,
                               extra_ldflags=omp, build_directory=str(build), is_python_module=False,
                               verbose=False)
            return torch.ops.loadplan_experts
        except Exception as e:  # a failed build or load: the next flags, then no kernel
            errors.append(f"{' '.join(flags)}: {str(e).strip()[-600:]}")
    raise OSError("; ".join(errors))


def library():
    """The compiled kernel's operators (torch.ops.loadplan_experts), built on the first call; None (and one
    logged warning with the reason) if it cannot be built."""
    global _OPS, _TRIED, _REASON
    if _TRIED:
        return _OPS
    with _LOCK:
        if not _TRIED:
            try:
                _OPS = _build()
            except Exception as e:  # any failure: the other implementations compute the same
                _REASON = f"{type(e).__name__}: {e}"
                log.warning("expert kernel: the compiled kernel is unavailable (%s); the experts run on the fastest "
                            "measured torch implementation", _REASON)
            _TRIED = True
    return _OPS


def unavailable_reason() -> str:
    """Why library() is None ("" while it is not, or before it was tried)."""
    return _REASON


def max_rows() -> int | None:
    """The most rows of one expert the compiled kernel computes well (None: any, with AVX-512; else 2, see
    TILES in expert_native.cpp); experts with more are left to torch's matmuls. 0 without the kernel."""
    lib = library()
    if lib is None:
        return 0
    n = lib.max_rows()
    return None if n < 0 else n


DTYPES = (torch.float32, torch.bfloat16)


def features() -> str:
    """What the built kernel computes with: "tiles=avx512|avx2 dpbf16=0|1" (dpbf16: bfloat16 dot products on
    AVX-512 BF16, found at run time); "" without the kernel."""
    lib = library()
    return "" if lib is None else lib.features()


def applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether run_spans can compute these tensors (float32 or bfloat16 alike, contiguous, on the CPU, sizes
    multiples of 16, nothing to differentiate)."""
    D, I = down.shape[1], down.shape[2]
    return (x.dtype == gate_up.dtype == down.dtype and x.dtype in DTYPES
            and x.device.type == gate_up.device.type == down.device.type == "cpu"
            and gate_up.is_contiguous() and down.is_contiguous()
            and gate_up.shape[1:] == (2 * I, D) and x.shape[-1] == D and D % 16 == 0 and I % 16 == 0
            and not (torch.is_grad_enabled() and (x.requires_grad or gate_up.requires_grad or down.requires_grad))
            and library() is not None)


def run_spans(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, w: torch.Tensor | None,
              out: torch.Tensor, spans: list[tuple[int, int, int, int]], x_rows: torch.Tensor | None = None,
              out_rows: torch.Tensor | None = None) -> None:
    """out[o(r0 + j)] = down_s(silu(gate_s(x[i(x0 + j)])) * up_s(x[i(x0 + j)])) * w[o(r0 + j)] for (s, x0, r0, m)
    in spans, j < m, where i(p) = x_rows[p] (p if None) and o(p) = out_rows[p] (p if None); on torch's intra-op
    threads. x contiguous [*, D] in the weights' dtype (float32 or bfloat16), out contiguous float32 [*, D] (the
    sums stay float32; the caller rounds); w float32 contiguous [*] or None; x_rows, out_rows int64 [*]."""
    if not spans:
        return
    assert x.is_contiguous() and out.is_contiguous() and out.dtype == torch.float32
    assert w is None or (w.is_contiguous() and w.dtype == torch.float32)
    t = torch.tensor(spans, dtype=torch.int64)                 # [n, 4]
    library().spans(x, gate_up, down, w, out, x_rows, out_rows, t, torch.get_num_threads())
