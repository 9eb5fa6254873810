"""GPU time of the single-LoRA delta ``y + (x A^T) B^T`` per linear layer: Triton kernels vs two cuBLAS GEMMs.

    python benchmarks/lora_delta.py [--out-dir benchmarks/results]        # -> lora_delta-<gpu>.json

What the single-LoRA vLLM path (``vllm_lora_backend="qerl"``) adds to each NVFP4 linear at decode, at Qwen2.5
layer shapes, r=32, bf16. Each arm is timed as vLLM runs decode: one call per distinct copy of the layer's A and
B, back to back inside one CUDA graph, replayed (:func:`graph_us`: the median of 5 timed batches).
The launch gaps are the graph's, not the host's. The
copies add up to 160 MB (at least 8 and at most 64 copies), so A and B mostly come from HBM, as in decode, where
every other layer's weights evict them from the 50 MB L2.

Rows ``{size, layer, rows, path, variant, bn, bk, us, vs_cublas, max_rel_err_vs_cublas}``. ``path`` is one of:

* ``cublas``: ``lora_delta_add_reference``, the two GEMMs;
* ``shipped``: ``lora_delta_add`` as the product dispatches it, up to ``KERNEL_MAX_ROWS`` rows;
* ``kernel``: with ``--sweep``, every ``SWEEP`` configuration of ``lora_kernels._launch``.

A per-step figure is printed: the sum over a layer's four linears times the number of layers.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._common import write_result  # noqa: E402
from qerl_trl.vllm_plugin import lora_kernels as lk  # noqa: E402

LAYERS = {"7b": 28, "14b": 48, "32b": 64}
#: a Qwen2.5 decoder layer's four vLLM linears: {name: (output sizes of the packed sub-modules, input size)}
SHAPES = {
    "7b": {"qkv": ([3584, 512, 512], 3584), "o": ([3584], 3584), "gate_up": ([18944, 18944], 3584),
           "down": ([3584], 18944)},
    "14b": {"qkv": ([5120, 1024, 1024], 5120), "o": ([5120], 5120), "gate_up": ([13824, 13824], 5120),
            "down": ([5120], 13824)},
    "32b": {"qkv": ([5120, 1024, 1024], 5120), "o": ([5120], 5120), "gate_up": ([27648, 27648], 5120),
            "down": ([5120], 27648)},
}  # fmt: skip


def graph_us(fns, replays: int = 30) -> float:
    """Microseconds per call with ``fns`` (one call each) captured back to back in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns[:2]:
            fn()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):  # the median of 5 timed batches of replays
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (replays * len(fns)))
    del graph
    return sorted(times)[2]


#: (variant, column block, K step) tried by ``--sweep``
SWEEP = [("split", 64, 128), ("serial", 64, 128), ("serial", 128, 128)]


def layer_copies(slot_rows: list[int], k: int, r: int, copies: int, dev: str, dt: torch.dtype):
    """``copies`` independent (A, block-diagonal B) pairs of one layer shape, and its slot bounds."""
    n, s = sum(slot_rows), len(slot_rows)
    out = []
    for _ in range(copies):
        lora_a = torch.randn(s * r, k, device=dev, dtype=dt) / k**0.5
        lora_b = torch.zeros(n, s * r, device=dev, dtype=dt)
        start = 0
        for j, rows in enumerate(slot_rows):
            lora_b[start : start + rows, j * r : (j + 1) * r] = torch.randn(rows, r, device=dev, dtype=dt)
            start += rows
        out.append((lora_a, lora_b))
    starts = [sum(slot_rows[:j]) for j in range(s)]
    return out, lk.lora_slot_bounds(starts, n, dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="*", default=["7b", "32b"], choices=list(SHAPES))
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 8, 16, 64, 128])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--sweep", action="store_true", help="time every kernel variant in SWEEP, not only the shipped one")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev, dt, r = "cuda", torch.bfloat16, a.rank
    rows_out = []
    for size in a.sizes:
        for m in a.rows:
            for name, (slot_rows, k) in SHAPES[size].items():
                n = sum(slot_rows)
                # enough distinct copies that the graph's calls read A and B from HBM, as decode does (every layer
                # in between evicts them from the 50 MB L2)
                layer_bytes = (len(slot_rows) * r * k + n * len(slot_rows) * r) * 2
                copies = max(8, min(64, -(-160 * 2**20 // layer_bytes)))
                pairs, bounds = layer_copies(slot_rows, k, r, copies, dev, dt)
                x = torch.randn(m, k, device=dev, dtype=dt)
                y = torch.randn(m, n, device=dev, dtype=dt)
                la, lb = pairs[0]
                want = lk.lora_delta_add_reference(y, x, la, lb).float()
                arms = {("cublas", None, None, None): lambda p: lk.lora_delta_add_reference(y, x, *p)}
                configs = SWEEP if a.sweep else []
                for v, bn, bk in configs:
                    arms[("kernel", v, bn, bk)] = (
                        lambda p, v=v, bn=bn, bk=bk: lk._launch(y, x, *p, bounds, r, variant=v, bn=bn, bk=bk))  # fmt: skip
                if m <= lk.KERNEL_MAX_ROWS:
                    arms[("shipped", None, None, None)] = lambda p: lk.lora_delta_add(y, x, *p, bounds, r)
                base = None
                for (path, v, bn, bk), fn in arms.items():
                    err = ((fn(pairs[0]).float() - want).abs().max() / want.abs().max()).item()
                    us = graph_us([lambda p=p: fn(p) for p in pairs])
                    base = us if path == "cublas" else base
                    rows_out.append(dict(size=size, layer=name, rows=m, rank=r, path=path, variant=v, bn=bn, bk=bk,
                                         us=round(us, 2), vs_cublas=round(base / us, 3),
                                         max_rel_err_vs_cublas=round(err, 5)))  # fmt: skip
                    print(f"{size} m={m:3d} {name:8s} {path:8s} {v or '':7s} {bn or '':>4} {bk or '':>4} {us:7.2f} us "
                          f"x{base / us:.2f} err {err:.1e}", flush=True)  # fmt: skip
            for path in ("cublas", "shipped"):
                sel = [x["us"] for x in rows_out if x["size"] == size and x["rows"] == m and x["path"] == path]
                if len(sel) == len(SHAPES[size]):
                    print(f"{size} m={m}: {path} per decode step (x{LAYERS[size]} layers) "
                          f"{sum(sel) * LAYERS[size] / 1000:.3f} ms", flush=True)  # fmt: skip
    print("wrote", write_result("lora_delta", rows_out, a.out_dir))


if __name__ == "__main__":
    main()
