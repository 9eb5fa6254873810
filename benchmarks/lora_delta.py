"""GPU time of the single-LoRA delta ``y + (x A^T) B^T`` per linear layer: Triton kernels vs two cuBLAS GEMMs.

    python benchmarks/lora_delta.py [--out-dir benchmarks/results]        # -> lora_delta-<gpu>.json

What the single-LoRA vLLM path (``vllm_lora_backend="qerl"``) adds to each NVFP4 linear at decode, at Qwen2.5
layer shapes, r=32, bf16. Each call is timed as vLLM runs decode: 20 calls back to back inside one CUDA graph,
replayed 200 times, so launch gaps are the graph's, not the host's. Rows ``{size, layer, rows, path, us}``, where
``path`` is ``kernel`` (:func:`qerl_trl.vllm_plugin.lora_kernels._launch`, the product path up to
``KERNEL_MAX_ROWS`` rows) or ``cublas`` (``lora_delta_add_reference``, the two GEMMs it replaced), plus
``kernel_vs_cublas``. A per-step figure: sum over a layer's four linears x the number of layers.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._common import write_result  # noqa: E402
from qerl_trl.vllm_plugin import lora_kernels as lk  # noqa: E402

#: (packed sub-module output rows, input size) of each LoRA'd linear of one decoder layer
SHAPES = {
    "7b": {"qkv": ([3584, 512, 512], 3584), "o": ([3584], 3584), "gate_up": ([18944, 18944], 3584),
           "down": ([3584], 18944)},
    "32b": {"qkv": ([5120, 1024, 1024], 5120), "o": ([5120], 5120), "gate_up": ([27648, 27648], 5120),
            "down": ([5120], 27648)},
}  # fmt: skip
LAYERS = {"7b": 28, "32b": 64}


def graph_us(fn, calls: int = 20, replays: int = 200) -> float:
    """Microseconds per ``fn()`` with ``calls`` calls captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="*", default=list(SHAPES))
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 8, 16, 64, 128])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev, dt, r = "cuda", torch.bfloat16, a.rank
    rows_out = []
    for size in a.sizes:
        for m in a.rows:
            for name, (slot_rows, k) in SHAPES[size].items():
                n, s = sum(slot_rows), len(slot_rows)
                x = torch.randn(m, k, device=dev, dtype=dt)
                y = torch.randn(m, n, device=dev, dtype=dt)
                lora_a = torch.randn(s * r, k, device=dev, dtype=dt) / k**0.5
                lora_b = torch.zeros(n, s * r, device=dev, dtype=dt)
                starts, start = [], 0
                for j, rows in enumerate(slot_rows):
                    lora_b[start : start + rows, j * r : (j + 1) * r] = torch.randn(rows, r, device=dev, dtype=dt)
                    starts.append(start)
                    start += rows
                bounds = lk.lora_slot_bounds(starts, n, dev)
                want = lk.lora_delta_add_reference(y, x, lora_a, lora_b).float()
                got = lk._launch(y, x, lora_a, lora_b, bounds, r).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                us = {"kernel": graph_us(lambda: lk._launch(y, x, lora_a, lora_b, bounds, r)),
                      "cublas": graph_us(lambda: lk.lora_delta_add_reference(y, x, lora_a, lora_b))}  # fmt: skip
                for path, t in us.items():
                    rows_out.append(dict(size=size, layer=name, rows=m, rank=r, path=path, us=round(t, 2),
                                         max_rel_err_vs_cublas=round(err, 5) if path == "kernel" else None,
                                         kernel_vs_cublas=round(us["cublas"] / us["kernel"], 3)))  # fmt: skip
                print(f"{size} m={m:3d} {name:8s} kernel {us['kernel']:6.2f} us  cublas {us['cublas']:6.2f} us  "
                      f"err {err:.1e}", flush=True)  # fmt: skip
            per_step = {p: sum(x["us"] for x in rows_out if x["size"] == size and x["rows"] == m and x["path"] == p)
                        * LAYERS[size] / 1000 for p in ("kernel", "cublas")}  # fmt: skip
            print(f"{size} m={m}: per decode step (x{LAYERS[size]} layers) kernel {per_step['kernel']:.3f} ms, "
                  f"cublas {per_step['cublas']:.3f} ms", flush=True)  # fmt: skip
    print("wrote", write_result("lora_delta", rows_out, a.out_dir))


if __name__ == "__main__":
    main()
