"""Why the fused NVFP4 kernels are slow at large M: the cost of a register-computed MMA operand in Triton.

    python benchmarks/fused_structure.py [--out-dir benchmarks/results]

On the Qwen2.5-7B gate_up shape (N=37888, K=3584), forward, for a few tile configs, times relative to BF16 cuBLAS:
``triton_smem`` a plain Triton bf16 matmul (both operands loaded straight into shared memory, pipelined);
``triton_reg`` the same loop with the bf16 weight passed through registers (an opaque identity), which is how
every dequantized tile reaches ``tl.dot``; ``triton_reg_as_a`` the weight in registers as the MMA's A operand
(swap-AB); ``nvfp4_fused`` our fused kernel with the same tile. The gap between ``triton_smem`` and
``triton_reg`` is the structural cost with zero dequantization work. Writes ``fused_structure-<gpu>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks._common import write_result  # noqa: E402
from qerl_trl.nvfp4 import format as F  # noqa: E402
from qerl_trl.nvfp4 import triton_kernels as tk  # noqa: E402

MODES = {0: "triton_smem", 1: "triton_reg", 2: "triton_reg_as_a"}


@triton.jit
def _bf16_matmul(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % group) % size_m)
    pid_n = (pid % group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (rm % M)[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + (rn % N)[:, None] * K + offs_k[None, :]
    if MODE == 2:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs)
        w = tl.load(w_ptrs)
        if MODE == 0:
            acc = tl.dot(x, tl.trans(w), acc)
        elif MODE == 1:
            acc = tl.dot(x, tl.trans(tk._opaque(w)), acc)
        else:
            acc = tl.dot(tk._opaque(w), tl.trans(x), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MODE == 2:
        acc = tl.trans(acc)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=mask)


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    args = ap.parse_args()
    torch.manual_seed(0)
    n, k = 2 * 18944, 3584
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    q = F.quantize(w)
    rows = []
    for m in args.tokens:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        t_cublas = bench(lambda: x @ w.t())
        for bm, bn, bk, warps, stages in [(128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (256, 128, 64, 8, 3),
                                          (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)]:
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
            row = dict(layer="qwen2.5-7b.gate_up", tokens=m, **{"pass": "fwd"}, cublas_ms=round(t_cublas, 5),
                       tile=f"{bm}x{bn}x{bk}", num_warps=warps, num_stages=stages)
            for mode, name in MODES.items():
                t = bench(lambda: _bf16_matmul[grid](x, w, y, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                                     GROUP_M=8, MODE=mode, num_warps=warps, num_stages=stages))
                row[f"{name}_vs_cublas"] = round(t / t_cublas, 3)
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT=1, num_warps=warps, num_stages=stages)
            row["nvfp4_fused_vs_cublas"] = round(bench(lambda: tk.nvfp4_matmul_fwd(x, *q, config=cfg)) / t_cublas, 3)
            rows.append(row)
            print(row, flush=True)
    print("wrote", write_result("fused_structure", rows, args.out_dir))


if __name__ == "__main__":
    main()
