"""vLLM's CPU fused MoE as a contender of bench/moe.py, run in vLLM's own environment (.venv-vllm).

    .venv-vllm/bin/python bench/vllm_moe_contender.py --threads N

bench/moe.py starts it as a child process and talks to it in JSON lines (one request on stdin, one answer on
stdout), so that its calls are interleaved with the bench's other contenders, call by call, under the same
background load:
- {"op": "load", "path": P}: a torch.save file {"dtype": "float32"|"bfloat16", "top_k": K, "layers": [{"router":
  [E, D], "w13": [E, 2I, D], "w2": [E, D, I]}, ...]}: the bench's weight sets (w13 = HF's gate_up_proj, rows
  [0, I) gate, [I, 2I) up, which is vLLM's w13 layout), prepacked once per layer with
  `vllm._custom_ops.cpu_prepack_moe_weight(w, isa)` as CPUUnquantizedExperts.process_weights_after_loading does
  (the intermediate size padded to vLLM's alignment where it is not already a multiple of it);
- {"op": "inputs", "path": P}: {"xs": [[x [T, D] per input] per layer]}, the bench's inputs;
- {"op": "check", "path": P}: the output of layer 0 on input 0 saved to P (the bench compares it to the reference);
- {"op": "run", "i": n}: the n-th timed call: layer n % layers, input (n // layers) % inputs (the bench's rotation);
  answers {"dt": seconds}, timed here (the pipe's round trip is not counted);
- {"op": "quit"}.
A call is the layer as the bench's other contenders compute it: the Qwen3-MoE router (x @ router^T, softmax in
float32, top-k, renormalised; in torch, as vLLM's CPU router computes it) and then
`vllm._custom_ops.cpu_fused_moe(out, x, w13p, w2p, None, None, topk_weights (float32), topk_ids (int32), "silu",
isa)` into a preallocated out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _kernels() -> tuple[str, str]:
    """Load vLLM's CPU kernels as vLLM does (the AVX-512 BF16, AVX-512 or AVX2 build) -> (isa, build)."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    if torch.cpu._is_avx512_supported():
        build = "_C (AVX-512 BF16)" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    else:
        build = "_C_AVX2"
    isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
    return isa, build


def _alignment() -> int:
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        return int(CPUUnquantizedExperts._intermediate_alignment())
    except Exception:  # an older layout of the class: vLLM pads to multiples of 32 (DESIGN 9.4)
        return 32


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import vllm
    from vllm import _custom_ops as ops

    isa, build = _kernels()
    align = _alignment()
    out_pipe = sys.stdout
    sys.stdout = sys.stderr                     # vLLM's own prints never reach the protocol
    say = lambda obj: (out_pipe.write(json.dumps(obj) + "\n"), out_pipe.flush())  # noqa: E731
    say({"ready": True, "vllm": vllm.__version__, "torch": torch.__version__, "isa": isa, "build": build,
         "threads": torch.get_num_threads(), "alignment": align})
    layers, xs, top_k = [], [], 0
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "load":
                data = torch.load(req["path"], mmap=True)
                top_k = int(data["top_k"])
                layers = []
                t0 = time.perf_counter()
                for lay in data["layers"]:
                    w13, w2 = lay["w13"].contiguous(), lay["w2"].contiguous()
                    E, I2, D = w13.shape
                    I = I2 // 2
                    Ip = (I + align - 1) // align * align
                    if Ip != I:                 # as CPUUnquantizedExperts._pad_moe_intermediate
                        p13 = w13.new_zeros(E, 2 * Ip, D)
                        p13[:, :I], p13[:, Ip:Ip + I] = w13[:, :I], w13[:, I:]
                        p2 = w2.new_zeros(E, D, Ip)
                        p2[:, :, :I] = w2
                        w13, w2 = p13, p2
                    layers.append({"router": lay["router"].contiguous().clone(),
                                   "w13": ops.cpu_prepack_moe_weight(w13.clone(), isa),
                                   "w2": ops.cpu_prepack_moe_weight(w2.clone(), isa)})
                say({"ok": True, "layers": len(layers), "prepack_s": round(time.perf_counter() - t0, 3)})
            elif op == "inputs":
                xs = torch.load(req["path"])["xs"]
                say({"ok": True})
            elif op == "check":
                with torch.inference_mode():
                    torch.save(forward(ops, isa, layers[0], xs[0][0], top_k), req["path"])
                say({"ok": True})
            elif op == "run":
                n = int(req["i"])
                lay = n % len(layers)
                x = xs[lay][(n // len(layers)) % len(xs[lay])]
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    forward(ops, isa, layers[lay], x, top_k)
                    dt = time.perf_counter() - t0
                say({"dt": dt})
            elif op == "quit":
                say({"ok": True})
                return
            else:
                say({"error": f"unknown op {op!r}"})
        except Exception as e:  # the bench reports it and stops
            say({"error": f"{type(e).__name__}: {e}"})


def forward(ops, isa: str, layer: dict, x: torch.Tensor, top_k: int) -> torch.Tensor:
    logits = torch.nn.functional.linear(x, layer["router"])
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    out = torch.empty_like(x)
    ops.cpu_fused_moe(out, x, layer["w13"], layer["w2"], None, None, w, ids.to(torch.int32), "silu", isa)
    return out


if __name__ == "__main__":
    main()
