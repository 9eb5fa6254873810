"""GPU time the single-LoRA delta ``y += (x A^T) B^T`` adds to one linear layer, around a base GEMM, as vLLM runs it.

    python benchmarks/lora_delta.py [--out-dir benchmarks/results]        # -> lora_delta-<gpu>.json

What the single-LoRA vLLM path (``vllm_lora_backend="qerl"``) adds to each NVFP4 linear at decode, at Qwen2.5 layer
shapes, r=32, bf16. The base GEMM's stand-in is a bf16 GEMM reading as many weight bytes as the NVFP4 layer
(``[N, K/4]`` bf16 against NVFP4's ``[N, K]`` at 4.5 bits), between the two LoRA ops as in the layer. Each arm is
timed as vLLM runs decode: one call per distinct copy of the layer's weights, back to back inside one CUDA graph,
replayed (:func:`graph_us`: the median of 5 timed batches). The copies add up to 160 MB or more (at least 4 and at
most 64), so the weights mostly come from HBM, as in decode, where every other layer's weights evict them from the
50 MB L2.

Rows ``{size, layer, rows, path, us, lora_us, max_rel_err}`` per arm (``path``):

* ``base``: the stand-in base GEMM alone;
* ``cublas``: base, then ``lora_delta_add_reference`` (two GEMMs, out of place: the path above 16 rows until
  2bfc0a4);
* ``shipped``: ``lora_shrink``, base, ``lora_expand_`` (in place), as ``SingleLoRALinearMethod`` runs them.

``lora_us`` is the arm's time less ``base``'s. A per-step figure is printed: the sum over a layer's four linears
times the number of layers.

``--partial-rows 2048 4096`` adds a ``shipped`` arm per value with the shrink's partial-row budget
(``lora_kernels.PARTIAL_ROWS``, 512) at that value (rows' ``partial_rows``): the budget caps the shrink's K splits
at ``budget / rows``, so at 64 rows ``down_proj``'s long-K shrink runs on 8 programs. In the 8 x 8 x 512 rollout
profile (``e2e_step-h200.json``, run 20261128T015559Z-e3dd8a) the shrinks took 8.7 µs a launch. ``--shrink-bm 16
32`` crosses those arms with a smaller largest row block (``lora_kernels._BM_MAX``, 64; rows' ``shrink_bm``): at 64
rows, 16-row blocks give 4 times the programs, and the program that sums a block's partials reads a quarter of them.
Both are read at each launch (:func:`shrink_settings`), so a CUDA graph captures them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._common import git_commit, gpu_uuid, write_result  # noqa: E402
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


@contextmanager
def shrink_settings(partial_rows: int, bm_max: int) -> Iterator[None]:
    """The single-LoRA ops with another partial-row budget and largest row block, then the shipped ones again. Both
    are module constants of ``lora_kernels`` read at each launch (and part of its compiled kernels' keys: ``bm``
    and ``k_chunk``), so a call made inside this block, or captured into a CUDA graph there, runs with them."""
    saved = lk.PARTIAL_ROWS, lk._BM_MAX
    lk.PARTIAL_ROWS, lk._BM_MAX = partial_rows, bm_max
    try:
        yield
    finally:
        lk.PARTIAL_ROWS, lk._BM_MAX = saved


def shrink_arms(budgets: list[int], bms: list[int], rows: int | None = None) -> list[tuple[int, int]]:
    """``(partial-row budget, largest row block)`` of each ``shipped`` arm: the shipped pair first, then every
    other combination of the shipped and the given values, once each; at ``rows`` rows, without a largest row block
    that launches as the shipped one does there (both at least the rows' block: 16 rows run in one 16-row block)."""
    def block(bm: int) -> int:
        if rows is None:
            return bm
        with shrink_settings(lk.PARTIAL_ROWS, bm):
            return lk._row_blocks(rows)[0]  # the row block the ops launch with at these rows

    combos = [(b, m) for b in [lk.PARTIAL_ROWS, *budgets] for m in [lk._BM_MAX, *bms]
              if m == lk._BM_MAX or block(m) != block(lk._BM_MAX)]  # fmt: skip
    return list(dict.fromkeys(combos))


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


def layer_copies(slot_rows: list[int], k: int, r: int, copies: int, dev: str, dt: torch.dtype):
    """``copies`` independent (base weight stand-in, A, block-diagonal B, partials) of one layer shape, and its
    slot bounds (semaphores: the copies' shrinks run one after another on one stream)."""
    n, s = sum(slot_rows), len(slot_rows)
    out = []
    for _ in range(copies):
        w = torch.randn(n, k // 4, device=dev, dtype=dt) / k**0.5
        lora_a = torch.randn(s * r, k, device=dev, dtype=dt) / k**0.5
        lora_b = torch.zeros(n, s * r, device=dev, dtype=dt)
        start = 0
        for j, rows in enumerate(slot_rows):
            lora_b[start : start + rows, j * r : (j + 1) * r] = torch.randn(rows, r, device=dev, dtype=dt)
            start += rows
        out.append((w, lora_a, lora_b, lk.lora_partials(s * r, dev)))
    starts = [sum(slot_rows[:j]) for j in range(s)]
    return out, lk.lora_slot_bounds(starts, n, s * r, dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="*", default=["7b", "32b"], choices=list(SHAPES))
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 16, 64, 128])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--partial-rows", nargs="*", type=int, default=[],
                    help="also time the shipped arm with the shrink's partial-row budget at each of these values")
    ap.add_argument("--shrink-bm", nargs="*", type=int, default=[], choices=[16, 32, 64],
                    help="and with each of these largest row blocks (crossed with --partial-rows)")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev, dt, r = "cuda", torch.bfloat16, a.rank
    rows_out = []
    commit, uuid = git_commit(), gpu_uuid()
    for size in a.sizes:
        for m in a.rows:
            for name, (slot_rows, k) in SHAPES[size].items():
                n = sum(slot_rows)
                # enough distinct copies that the graph's calls read the weights from HBM, as decode does (every
                # layer in between evicts them from the 50 MB L2)
                layer_bytes = (n * (k // 4) + len(slot_rows) * r * k + n * len(slot_rows) * r) * 2
                copies = max(4, min(64, -(-160 * 2**20 // layer_bytes)))
                settings = shrink_arms(a.partial_rows, a.shrink_bm, m)
                # every arm's partials and semaphores fit each layer's scratch
                with shrink_settings(max(b for b, _ in settings), min(m for _, m in settings)):
                    layers, bounds = layer_copies(slot_rows, k, r, copies, dev, dt)
                x = torch.randn(m, k, device=dev, dtype=dt)
                xq = x[:, : k // 4]

                def base(p):
                    return xq @ p[0].t()

                def cublas(p):
                    return lk.lora_delta_add_reference(base(p), x, p[1], p[2])

                def shipped(p):
                    shrunk = lk.lora_shrink(x, p[1], bounds, p[3], r, n)
                    y = base(p)
                    lk.lora_expand_(y, shrunk, p[2], bounds, p[3], r, k)
                    return y

                def with_settings(budget, bm):
                    def fn(p):
                        with shrink_settings(budget, bm):  # read by the launches (captured into the graph)
                            return shipped(p)
                    return fn

                want = cublas(layers[0]).float()
                base_us = None
                arms = [("base", base, None, None), ("cublas", cublas, None, None)]
                arms += [("shipped", with_settings(b, bm), b, bm) for b, bm in settings]
                for path, fn, budget, bm in arms:
                    err = None if path == "base" else (
                        (fn(layers[0]).float() - want).abs().max() / want.abs().max()).item()
                    us = graph_us([lambda p=p: fn(p) for p in layers])
                    base_us = us if path == "base" else base_us
                    rows_out.append(dict(size=size, layer=name, rows=m, rank=r, path=path, us=round(us, 2),
                                         lora_us=round(us - base_us, 2), max_rel_err=err and round(err, 5),
                                         commit=commit, gpu_uuid=uuid,
                                         **({"partial_rows": budget} if budget else {}),
                                         **({"shrink_bm": bm} if bm and bm != lk._BM_MAX else {})))  # fmt: skip
                    print(f"{size} m={m:3d} {name:8s} {path:8s} {budget or '':>5} {bm or '':>3} {us:7.2f} us  LoRA "
                          f"{us - base_us:6.2f} us  err {err}", flush=True)  # fmt: skip
                del layers
            for path, budget, bm in [("base", None, None), ("cublas", None, None)] + [
                    ("shipped", b, bm) for b, bm in shrink_arms(a.partial_rows, a.shrink_bm, m)]:
                sel = [x for x in rows_out if x["size"] == size and x["rows"] == m and x["path"] == path
                       and x.get("partial_rows") == budget
                       and x.get("shrink_bm") == (bm if bm != lk._BM_MAX else None)]  # fmt: skip
                if len(sel) == len(SHAPES[size]):
                    tot = sum(x["us"] for x in sel) * LAYERS[size] / 1000
                    lora = sum(x["lora_us"] for x in sel) * LAYERS[size] / 1000
                    print(f"{size} m={m}: {path} {budget or ''} {bm or ''} per decode step (x{LAYERS[size]} layers) "
                          f"{tot:.3f} ms, LoRA {lora:.3f} ms", flush=True)  # fmt: skip
    print("wrote", write_result("lora_delta", rows_out, a.out_dir))


if __name__ == "__main__":
    main()
