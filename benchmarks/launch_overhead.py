"""Host (CPU) cost of one NVFP4 matmul call, next to one BF16 ``torch.matmul``, and the dequantize pass's configs.

    python benchmarks/launch_overhead.py [--out-dir benchmarks/results]

Part 1, ``part="host_us"``: microseconds of Python + driver per call, from enqueueing 300 calls of a 16-row
Qwen2.5-7B o-proj matmul (3584x3584) back to back, which the GPU finishes faster than the host issues them, so
the time measured is the host's. It matters wherever the GPU would otherwise wait for the host: the 0.08-0.2 ms
training matmuls at 2048 rows and every eager decode-sized call. Rows ``{part, call, host_us}``.

Part 2, ``part="dequant"``: the one-pass dequantize kernel (``triton_kernels._dequant_kernel``, the first half of
the ``dequant_mm`` path) over tile configs on Qwen shapes, medians of ``triton.testing.do_bench`` with L2 flushed,
and the achieved bandwidth (packed + scales read, 16-bit Ŵ written). Rows ``{part, layer, config, ms, tb_per_s,
exact}``; ``config`` = rows x warps x row steps x columns; the shipped one is ``triton_kernels._DEQUANT_CFG``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._common import write_result  # noqa: E402
from qerl_trl.nvfp4 import format as F  # noqa: E402
from qerl_trl.nvfp4 import gluon_kernels as gk  # noqa: E402
from qerl_trl.nvfp4 import ops  # noqa: E402
from qerl_trl.nvfp4 import triton_kernels as tk  # noqa: E402

DEQUANT_SHAPES = {"qwen2.5-7b.qkv": (4608, 3584), "qwen2.5-7b.o": (3584, 3584), "qwen2.5-7b.down": (3584, 18944),
                  "qwen2.5-7b.gate_up": (37888, 3584), "qwen2.5-32b.qkv": (7168, 5120), "qwen2.5-32b.o": (5120, 5120)}
DEQUANT_CONFIGS = [(16, 4, 4, 256), (8, 8, 4, 256), (4, 4, 8, 256), (8, 4, 2, 1024), (8, 4, 1, 1024),
                   (16, 4, 1, 1024), (4, 4, 2, 1024), (8, 4, 1, 2048)]


def host_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return round((t1 - t0) / n * 1e6, 2)


def main() -> None:
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    rows = []
    w = (torch.randn(3584, 3584, device=dev) * 0.02).bfloat16()
    q = F.quantize(w)
    x = torch.randn(16, 3584, device=dev, dtype=torch.bfloat16)
    calls = {
        "bf16 x @ w.t()": lambda: x @ w.t(),
        "torch.zeros (fp32 split-K buffer)": lambda: torch.zeros(16, 3584, device=dev, dtype=torch.float32),
        "ops.nvfp4_linear_forward (dispatched)": lambda: ops.nvfp4_linear_forward(x, *q),
        "ops.nvfp4_linear_dgrad (dispatched)": lambda: ops.nvfp4_linear_dgrad(x, *q),
        "triton_kernels.nvfp4_dequantize": lambda: tk.nvfp4_dequantize(*q),
        "ops.dequant_matmul fwd": lambda: ops.dequant_matmul("fwd", x, *q),
    }
    if gk.skinny_supported(x, q.weight_packed):
        calls["gluon_kernels.nvfp4_matmul_fwd_skinny"] = lambda: gk.nvfp4_matmul_fwd_skinny(x, *q)
    for name, fn in calls.items():
        rows.append(dict(part="host_us", call=name, host_us=host_us(fn)))
        print(rows[-1], flush=True)

    for layer, (n, k) in DEQUANT_SHAPES.items():
        qq = F.quantize((torch.randn(n, k, device=dev) * 0.02).bfloat16())
        ref = F.dequantize(*qq, dtype=torch.bfloat16)
        out = torch.empty_like(ref)
        nbytes = n * k // 2 + n * k // 16 + n * k * 2
        wq, sc = qq.weight_packed.view(torch.int32), qq.weight_scale.view(torch.uint8)
        for br, warps, steps, bc in DEQUANT_CONFIGS:
            grid = (triton.cdiv(n, br * steps), triton.cdiv(k, bc))

            def run():
                tk._dequant_kernel[grid](wq, sc, qq.weight_global_scale, out, n, k, BLOCK_R=br, BLOCK_C=bc,
                                         ROW_STEPS=steps, USE_ASM=True, num_warps=warps)
            out.zero_()
            run()
            exact = torch.equal(out, ref)
            ms = triton.testing.do_bench(run, warmup=10, rep=80, return_mode="median")
            rows.append(dict(part="dequant", layer=layer, config=f"{br}x{warps}x{steps}x{bc}", ms=round(ms, 5),
                             tb_per_s=round(nbytes / ms / 1e9, 2), exact=exact,
                             shipped=dict(BLOCK_R=br, BLOCK_C=bc, ROW_STEPS=steps) == tk._DEQUANT_CFG
                             and warps == tk._DEQUANT_WARPS))
            print(rows[-1], flush=True)
    print("wrote", write_result("launch_overhead", rows, args.out_dir))


if __name__ == "__main__":
    main()
