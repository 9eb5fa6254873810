"""Training-pass NVFP4 matmuls on Qwen2.5-7B/32B layer shapes: BF16 cuBLAS vs naive dequantize+matmul vs ours.

    python benchmarks/train_matmul.py [--out-dir benchmarks/results] [--tokens 16 64 256 2048 8192]

Forward ``y = x @ Wᵀ`` and input gradient ``dx = dy @ W`` per layer; times are medians of
``triton.testing.do_bench`` (CUDA events, warm-up, L2 flushed before every repeat) with weights rotated over
several copies. Writes ``<out-dir>/train_matmul-<gpu>.json`` rows ``{layer, tokens, pass, bf16_ms, naive_ms,
nvfp4_ms}``: ``naive`` is QeRL's PyTorch unpack + cuBLAS, ``nvfp4`` what ``NVFP4Linear`` runs (the dispatch in
``qerl_trl.nvfp4.ops``). Each row also times each path the dispatch can pick, ``dequant_mm_ms`` (one Triton
dequantize pass + cuBLAS) and, for forwards up to 64 rows, ``skinny_ms`` (the Gluon decode kernel), and names
the one dispatched (``nvfp4_path``) with its error against the fp32 reference. Up to 64 rows it also replays BF16,
the dispatched path and the skinny kernel from CUDA graphs (``bf16_graph_ms``, ``nvfp4_graph_ms``,
``skinny_graph_ms``; one graph calls every weight copy in turn, so weights come from HBM, not L2): decode runs
that way, and eager timing of a ~10 µs matmul mostly measures Python launch cost. A few seconds of warm-up precede
the first layer.

``benchmarks/results/train_matmul-h200.json`` (at b0fee67) also has the columns of the paths removed since
(``fused_ms``: Triton kernels that dequantize in registers; ``ws_ms``: warp-specialized Gluon kernels; the skinny
input gradient): they won on no product path there.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._common import write_result  # noqa: E402
from qerl_trl.nvfp4 import format as F  # noqa: E402
from qerl_trl.nvfp4 import ops  # noqa: E402
from qerl_trl.nvfp4 import gluon_kernels as gk  # noqa: E402

SHAPES = {  # layer -> (N = out_features, K = in_features)
    "qwen2.5-7b.qkv": (3584 + 2 * 512, 3584),
    "qwen2.5-7b.o": (3584, 3584),
    "qwen2.5-7b.gate_up": (2 * 18944, 3584),
    "qwen2.5-7b.down": (3584, 18944),
    "qwen2.5-32b.qkv": (5120 + 2 * 1024, 5120),
    "qwen2.5-32b.o": (5120, 5120),
    "qwen2.5-32b.gate_up": (2 * 27648, 5120),
    "qwen2.5-32b.down": (5120, 27648),
}


def bench(fns, warmup=25, rep=100):
    """Median ms over calls that cycle through ``fns`` (one per weight copy)."""
    import triton

    it = [0]

    def call():
        f = fns[it[0] % len(fns)]
        it[0] += 1
        return f()

    return triton.testing.do_bench(call, warmup=warmup, rep=rep, return_mode="median")


GRAPH_MAX_M = 64


def graph_ms(fns) -> float:
    """Median ms per call of ``fns`` (one per weight copy) replayed from one CUDA graph: no Python launch cost,
    and the copies together exceed L2, so every call reads its weight from HBM as a decode step does (Triton's
    ``do_bench_cudagraph`` does not flush L2; replaying one small weight would time L2 reads)."""
    import triton

    def calls():
        for f in fns:
            f()

    calls()
    return round(triton.testing.do_bench_cudagraph(calls, rep=50, return_mode="median") / len(fns), 5)


def warm_up(seconds: float = 3.0) -> None:
    """Bring the GPU to its steady clocks and initialise cuBLAS and our kernels before the first timed layer
    (on a fresh machine the first layer otherwise read slow in every column)."""
    import time

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    q = F.quantize(a[:1024])
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            a @ a
            ops.nvfp4_linear_forward(a[:64], *q)
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 2048, 8192])
    ap.add_argument("--layers", nargs="+", default=list(SHAPES))
    args = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    warm_up()
    rows = []
    for layer in args.layers:
        n, k = SHAPES[layer]
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        q = F.quantize(w)
        fp4_bytes = F.nbytes(q)
        copies = max(2, min(32, math.ceil(200e6 / fp4_bytes)))  # rotated fp4 weights: 4x L2
        qs = [tuple(t.clone() for t in q) for _ in range(copies)]
        ws = [w.clone() for _ in range(copies)]
        w_ref = F.dequantize(*q, dtype=torch.float32)
        del w
        for m in args.tokens:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
            for pas in ("fwd", "dgrad"):
                a = x if pas == "fwd" else dy
                dispatched = ops.nvfp4_linear_forward if pas == "fwd" else ops.nvfp4_linear_dgrad
                naive = ops.reference_forward if pas == "fwd" else ops.reference_dgrad
                out = dispatched(a, *q)  # the dispatch decides (and compiles) once per (pass, M bucket, shape)
                ref = a.float() @ (w_ref.t() if pas == "fwd" else w_ref)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                del out, ref
                if pas == "fwd":
                    t_bf16 = bench([lambda W=W: a @ W.t() for W in ws])
                else:
                    t_bf16 = bench([lambda W=W: a @ W for W in ws])
                t_deq_mm = bench([lambda Q=Q: ops.dequant_matmul(pas, a, *Q) for Q in qs])
                t_naive = bench([lambda Q=Q: naive(a, *Q) for Q in qs])
                t_ours = bench([lambda Q=Q: dispatched(a, *Q) for Q in qs])
                t_skinny = None
                if pas == "fwd" and gk.skinny_supported(a, q.weight_packed):
                    t_skinny = bench([lambda Q=Q: gk.nvfp4_matmul_fwd_skinny(a, *Q) for Q in qs])
                graph = {}
                if m <= GRAPH_MAX_M:  # decode-sized: also time inside CUDA graphs
                    graph["bf16_graph_ms"] = graph_ms([lambda W=W: a @ (W.t() if pas == "fwd" else W) for W in ws])
                    graph["nvfp4_graph_ms"] = graph_ms([lambda Q=Q: dispatched(a, *Q) for Q in qs])
                    if t_skinny is not None:
                        graph["skinny_graph_ms"] = graph_ms([lambda Q=Q: gk.nvfp4_matmul_fwd_skinny(a, *Q) for Q in qs])
                    graph["nvfp4_graph_vs_bf16"] = round(graph["nvfp4_graph_ms"] / graph["bf16_graph_ms"], 3)
                row = dict(layer=layer, tokens=m, **{"pass": pas}, bf16_ms=round(t_bf16, 5),
                           naive_ms=round(t_naive, 5), nvfp4_ms=round(t_ours, 5),
                           nvfp4_vs_bf16=round(t_ours / t_bf16, 3), naive_vs_bf16=round(t_naive / t_bf16, 3),
                           dequant_mm_ms=round(t_deq_mm, 5),
                           skinny_ms=None if t_skinny is None else round(t_skinny, 5), **graph,
                           nvfp4_path=ops.triton_path(pas, a, *q), rel_err=float(f"{err:.3g}"), N=n, K=k)
                rows.append(row)
                print(f"{layer:20s} M={m:5d} {pas:5s} bf16 {t_bf16:7.4f} naive {t_naive:7.4f} deq+mm {t_deq_mm:7.4f} "
                      f"({t_deq_mm / t_bf16:4.2f}x) ours {t_ours / t_bf16:4.2f}x ({row['nvfp4_path']}) err {err:.1e}",
                      flush=True)
            del x, dy
        del qs, ws, w_ref, q
        torch.cuda.empty_cache()
        write_result("train_matmul", rows, args.out_dir)  # after every layer: a cut-off run keeps what it measured
    print("wrote", write_result("train_matmul", rows, args.out_dir))


if __name__ == "__main__":
    main()
