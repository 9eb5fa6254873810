"""GPU time of one NVFP4A16 linear at decode sizes: QeRL's fused kernel against Marlin and cuBLAS BF16.

    python benchmarks/decode_linear.py [--sizes 7b 14b 32b] [--impls qerl marlin marlin_lora cublas_bf16]
                                       [--sweep] [--out-dir benchmarks/results]     # -> decode_linear-<gpu>.json

Every LoRA'd linear of a Qwen2.5 decoder layer (qkv, o, gate_up, down) at 1-256 rows, bf16, as a rollout engine runs
it. Arms, all in one process:

* ``qerl``: ``decode_gemm.nvfp4_lora_linear`` at ``lora_r`` 0 (the FP4 GEMM alone) and ``--lora-r`` (its fused LoRA:
  the shrink launch plus the expand in the GEMM's epilogue);
* ``marlin``: vLLM's ``apply_fp4_marlin_linear`` on the same weight, repacked by ``prepare_fp4_layer_for_marlin``
  (what vLLM 0.24 serves NVFP4A16 with on Hopper; needs vLLM);
* ``marlin_lora``: Marlin then today's single-LoRA delta (``lora_kernels.lora_delta_add``: two launches);
* ``cublas_bf16``: ``torch.nn.functional.linear`` on a dense bf16 weight (TRL's merged BF16 rollouts).

Timing: one call per distinct copy of the layer, back to back in one CUDA graph, the graph replayed; the copies add
up to at least :data:`ROTATE_BYTES` so each call reads its weight from HBM as decode does (every other layer evicts
it from the 50 MB L2). ``gbps`` counts the bytes each arm must read and write once (weight, scales, LoRA, x, y);
``pct_hbm`` sets it against the datasheet bandwidth, ``pct_copy`` against a device-to-device copy measured in the
same run. Rows ``{size, layer, m, impl, lora_r, us, gbps, pct_hbm, pct_copy, max_rel_err, commit}``; per (size, m)
``layer == "layer_sum"`` rows add the four linears, and ``targets`` rows set them against issue #24's targets.
A configuration that fails or runs out of memory stays as a row with its ``status``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._common import git_commit, gpu_tag, write_result  # noqa: E402
from qerl_trl.nvfp4.format import dequantize  # noqa: E402
from qerl_trl.vllm_plugin import decode_gemm as dg  # noqa: E402
from qerl_trl.vllm_plugin import lora_kernels as lk  # noqa: E402

#: (packed sub-module output rows, input size) of each linear of one Qwen2.5 decoder layer
SHAPES = {
    "7b": {"qkv": ([3584, 512, 512], 3584), "o": ([3584], 3584), "gate_up": ([18944, 18944], 3584),
           "down": ([3584], 18944)},
    "14b": {"qkv": ([5120, 1024, 1024], 5120), "o": ([5120], 5120), "gate_up": ([13824, 13824], 5120),
            "down": ([5120], 13824)},
    "32b": {"qkv": ([5120, 1024, 1024], 5120), "o": ([5120], 5120), "gate_up": ([27648, 27648], 5120),
            "down": ([5120], 27648)},
}  # fmt: skip
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
IMPLS = ["qerl", "marlin", "marlin_lora", "cublas_bf16"]
ROTATE_BYTES = 160 * 2**20  # >= 3x the H100's 50 MB L2
DATASHEET_TBPS = {"h100": 3.35, "h200": 4.8}
#: issue #24's targets, on a 7B layer's four linears summed (LoRA r 32 included): (m range, what, ratio)
TARGETS = [((1, 16), "qerl_lora_vs_marlin", 1.4), ((1, 16), "pct_hbm", 60.0), ((64, 64), "qerl_lora_vs_cublas", 2.0),
           ((128, 128), "qerl_lora_vs_cublas", 1.5), ((256, 256), "qerl_lora_vs_cublas", 1.1),
           ((1, 256), "lora_overhead_pct_max", 8.0)]  # fmt: skip


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


def copy_tbps() -> float:
    """Device-to-device copy bandwidth (bytes read + written), TB/s."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = graph_us([lambda: b.copy_(a)], replays=20)
    del a, b
    return 2 * 2**30 / us / 1e6


def fp4_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * k // 16 + 4


def random_nvfp4(n: int, k: int, dev: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes, E4M3 scales in [2^-3, 2^3) and a global scale: a weight of realistic magnitude, not zeros."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.exp2(torch.rand(n, k // 16, device=dev) * 6 - 3).to(torch.float8_e4m3fn)
    return packed, scale, torch.tensor([448.0 * 6.0 / 2.0], device=dev)


def lora_pair(slot_rows: list[int], k: int, r: int, dev: str, dt: torch.dtype):
    n, s = sum(slot_rows), len(slot_rows)
    a = torch.randn(s * r, k, device=dev, dtype=dt) / k**0.5
    b = torch.zeros(n, s * r, device=dev, dtype=dt)
    start = 0
    for j, rows in enumerate(slot_rows):
        b[start : start + rows, j * r : (j + 1) * r] = torch.randn(rows, r, device=dev, dtype=dt) * 0.05
        start += rows
    return a, b


def marlin_layer(packed, scale, gscale, dt):
    """A module holding one NVFP4A16 weight as vLLM 0.24's compressed-tensors scheme leaves it before Marlin's
    repack (``weight``, ``weight_scale``, ``weight_global_scale`` = 1 / the checkpoint's), repacked for Marlin."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import prepare_fp4_layer_for_marlin

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(packed.clone(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale.clone(), requires_grad=False)
    layer.weight_global_scale = torch.nn.Parameter((1.0 / gscale).float(), requires_grad=False)
    layer.output_size_per_partition, layer.input_size_per_partition = packed.shape[0], packed.shape[1] * 2
    layer.params_dtype = dt
    prepare_fp4_layer_for_marlin(layer)
    return layer


def marlin_apply(layer, x):
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import apply_fp4_marlin_linear

    return apply_fp4_marlin_linear(input=x, weight=layer.weight, weight_scale=layer.weight_scale,
                                   weight_global_scale=layer.weight_global_scale, workspace=layer.workspace,
                                   size_n=layer.output_size_per_partition, size_k=layer.input_size_per_partition)


def bench_layer(size: str, name: str, slot_rows: list[int], k: int, rows: list[int], impls: list[str], r: int,
                dt: torch.dtype, peak_tbps: float, copy_peak: float, sweep: list[dict], commit: str) -> list:
    dev = "cuda"
    n, s = sum(slot_rows), len(slot_rows)
    out = []
    fp4 = fp4_bytes(n, k)
    copies = max(2, math.ceil(ROTATE_BYTES / fp4))
    weights = [random_nvfp4(n, k, dev) for _ in range(copies)]
    loras = [lora_pair(slot_rows, k, r, dev, dt) for _ in range(copies)]
    bounds = lk.lora_slot_bounds([sum(slot_rows[:j]) for j in range(s)], n, dev)
    sems = dg.decode_workspace(n, dev)
    w_ref = dequantize(*weights[0], torch.float32)
    lora_bytes = (s * r * k + n * r) * 2
    marlins = None
    if "marlin" in impls or "marlin_lora" in impls:
        try:
            marlins = [marlin_layer(*w, dt) for w in weights]
        except Exception as e:  # recorded, not fatal: the other arms still run
            marlins = e
    bf16 = None
    if "cublas_bf16" in impls:
        bf16_copies = max(2, math.ceil(ROTATE_BYTES / (n * k * 2)))
        bf16 = [w_ref.to(dt) for _ in range(bf16_copies)]
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=dt)
        want_base = x.float() @ w_ref.t()
        la, lb = loras[0]
        want_lora = want_base + (x @ la.t()).float() @ lb.float().t()
        arms = []  # (impl, lora_r, config, per-copy fns, first-copy fn, want, bytes)
        io = (m * k + m * n) * 2
        if "qerl" in impls:
            for cfg in [None] + [dg.decode_config(m, n, k, x.device, **kw) for kw in sweep]:
                arms.append(("qerl", 0, cfg, [lambda w=w, c=cfg: dg._launch(x, w[0], w[1].view(torch.uint8), w[2],
                                                                           None, None, None, 0, sems, c)
                                              for w in weights], want_base, fp4 + io))  # fmt: skip
            arms.append(("qerl", r, None, [lambda w=w, lo=lo: dg.nvfp4_lora_linear(x, w[0], w[1], w[2], lo[0], lo[1],
                                                                                   bounds, r, sems)
                                           for w, lo in zip(weights, loras)], want_lora, fp4 + io + lora_bytes))  # fmt: skip
        if isinstance(marlins, list):
            if "marlin" in impls:
                arms.append(("marlin", 0, None, [lambda ml=ml: marlin_apply(ml, x) for ml in marlins], want_base,
                             fp4 + io))
            if "marlin_lora" in impls:
                arms.append(("marlin_lora", r, None,
                             [lambda ml=ml, lo=lo: lk.lora_delta_add(marlin_apply(ml, x), x, lo[0], lo[1], bounds, r)
                              for ml, lo in zip(marlins, loras)], want_lora, fp4 + io + lora_bytes))  # fmt: skip
        elif marlins is not None:
            out.append(dict(size=size, layer=name, m=m, impl="marlin", lora_r=0, status=f"failed: {marlins!r}"[:300],
                            commit=commit))
        if bf16 is not None:
            arms.append(("cublas_bf16", 0, None, [lambda w=w: torch.nn.functional.linear(x, w) for w in bf16],
                         want_base, n * k * 2 + io))
        for impl, lr, cfg, fns, want, nbytes in arms:
            row = dict(size=size, layer=name, m=m, impl=impl, lora_r=lr, commit=commit)
            if cfg is not None:
                row["config"] = dict(bn=cfg.bn, bk=cfg.bk, bt=cfg.bt, splits=cfg.splits, warps=cfg.warps,
                                     stages=cfg.stages, tma=cfg.tma, quad=cfg.quad)
            elif impl == "qerl":
                c = dg.decode_config(m, n, k, x.device)
                row["config"] = dict(bn=c.bn, bk=c.bk, bt=c.bt, splits=c.splits, warps=c.warps, stages=c.stages,
                                     tma=c.tma, quad=c.quad, shipped=True)
            try:
                got = fns[0]().float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                us = graph_us(fns)
                gbps = nbytes / us / 1e3
                row.update(status="ok", us=round(us, 2), gbps=round(gbps, 1),
                           pct_hbm=round(100 * gbps / 1e3 / peak_tbps, 1),
                           pct_copy=round(100 * gbps / 1e3 / copy_peak, 1), max_rel_err=round(err, 5))
            except torch.OutOfMemoryError as e:
                row.update(status=f"oom: {str(e)[:200]}")
            except Exception as e:  # noqa: BLE001 - a failed configuration stays as a row
                row.update(status=f"failed: {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc()
            torch.cuda.synchronize()
            out.append(row)
            print(f"{size} {name:8s} m={m:3d} {impl:12s} r={lr:2d} {str(row.get('config', ''))[:70]:70s} "
                  f"{row.get('us', '-'):>8} us {row.get('pct_hbm', '-'):>5}% hbm err {row.get('max_rel_err', '-')} "
                  f"{'' if row['status'] == 'ok' else row['status'][:80]}", flush=True)  # fmt: skip
    del weights, loras, marlins, bf16, w_ref
    torch.cuda.empty_cache()
    return out


def summarize(rows: list, sizes: list[str], peak_tbps: float, commit: str) -> list:
    """Per (size, m): each arm summed over the layer's four linears (the shipped config), and the targets."""
    out = []
    ok = [x for x in rows if x.get("status") == "ok" and x["layer"] in ("qkv", "o", "gate_up", "down")
          and (x["impl"] != "qerl" or x.get("config", {}).get("shipped", False))]
    for size in sizes:
        for m in sorted({x["m"] for x in ok if x["size"] == size}):
            sums = {}
            for impl, lr in {(x["impl"], x["lora_r"]) for x in ok if x["size"] == size and x["m"] == m}:
                sel = [x for x in ok if x["size"] == size and x["m"] == m and x["impl"] == impl and x["lora_r"] == lr]
                if len(sel) == 4:
                    us = sum(x["us"] for x in sel)
                    gbps = sum(x["gbps"] * x["us"] for x in sel) / us
                    sums[(impl, lr)] = us
                    out.append(dict(size=size, layer="layer_sum", m=m, impl=impl, lora_r=lr, status="ok",
                                    us=round(us, 2), gbps=round(gbps, 1), pct_hbm=round(100 * gbps / 1e3 / peak_tbps, 1),
                                    commit=commit))  # fmt: skip
            q0 = sums.get(("qerl", 0))
            ql = next((v for (i, lr), v in sums.items() if i == "qerl" and lr > 0), None)
            ratios = {}
            if ql and sums.get(("marlin", 0)):
                ratios["qerl_lora_vs_marlin"] = sums[("marlin", 0)] / ql
            if ql and sums.get(("cublas_bf16", 0)):
                ratios["qerl_lora_vs_cublas"] = sums[("cublas_bf16", 0)] / ql
            if q0 and ql:
                ratios["lora_overhead_pct_max"] = 100 * (ql / q0 - 1)
            if ql:
                sel = [x for x in out if x["size"] == size and x["m"] == m and x["impl"] == "qerl" and x["lora_r"] > 0]
                ratios["pct_hbm"] = sel[0]["pct_hbm"]
            for (lo, hi), what, target in TARGETS:
                if lo <= m <= hi and what in ratios:
                    v = ratios[what]
                    met = v <= target if what == "lora_overhead_pct_max" else v >= target
                    out.append(dict(size=size, layer="targets", m=m, impl=what, value=round(v, 3), target=target,
                                    met=bool(met), status="ok", commit=commit))  # fmt: skip
    return out


def sweep_configs(names: list[str]) -> list[dict]:
    """``bn:bk:warps:stages:waves[:bt_max[:tma[:quad]]]`` strings -> ``decode_config`` keyword sets."""
    keys = ("bn", "bk", "warps", "stages", "waves", "bt_max", "tma", "quad")
    return [dict(zip(keys, (int(v) for v in s.split(":")))) for s in names]


def sass_summary(m: int, n: int, k: int, lora_r: int) -> dict:
    """Instruction counts of the compiled kernel's SASS for one shape (are the MMAs wgmma, the loads 128-bit?)."""
    import re

    packed, scale, gscale = random_nvfp4(n, k, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dg._gemm_launch.clear()
    seen = []
    real = dg._gemm_launch.fn

    class Spy:  # keep the CompiledKernel that Triton's own path returns
        params = real.params
        __name__ = "spy"

        def __getitem__(self, grid):
            def call(*args, **kw):
                seen.append(real[grid](*args, **kw))
                return seen[-1]
            return call

    dg._gemm_launch.fn = Spy()
    try:
        if lora_r:
            a, b = lora_pair([n], k, lora_r, "cuda", torch.bfloat16)
            bounds = lk.lora_slot_bounds([0], n, "cuda")
            dg.nvfp4_lora_linear(x, packed, scale, gscale, a, b, bounds, lora_r, dg.decode_workspace(n, "cuda"))
        else:
            dg._launch(x, packed, scale.view(torch.uint8), gscale, None, None, None, 0, dg.decode_workspace(n, "cuda"))
    finally:
        dg._gemm_launch.fn = real
        dg._gemm_launch.clear()
    sass = seen[-1].asm.get("sass", "")
    ops = {}
    for op in re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M):
        ops[op] = ops.get(op, 0) + 1
    keys = ("HGMMA", "HMMA", "LDG", "LDS", "STS", "LDSM", "PRMT", "LOP3", "HFMA2", "FFMA", "BAR", "LDL", "STL")
    summary = {k_: sum(v for o, v in ops.items() if o.startswith(k_)) for k_ in keys}
    summary["ldg_kinds"] = sorted({o for o in ops if o.startswith("LDG")})
    summary["regs"] = getattr(seen[-1], "n_regs", None)
    summary["spills"] = getattr(seen[-1], "n_spills", None)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="*", default=list(SHAPES))
    ap.add_argument("--layers", nargs="*", default=None, help="default: all four")
    ap.add_argument("--rows", nargs="*", type=int, default=ROWS)
    ap.add_argument("--impls", nargs="*", default=IMPLS, choices=IMPLS)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--sweep", nargs="*", default=[], help="extra qerl configs bn:bk:warps:stages:waves")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="", help="suffix of the result file's name")
    ap.add_argument("--sass", action="store_true", help="print the SASS summary of 7B shapes and exit")
    a = ap.parse_args()
    if a.sass:
        for m in (1, 16, 64, 256):
            for n, k in ((4608, 3584), (37888, 3584), (3584, 18944)):
                for r in (0, 32):
                    print(f"SASS m={m} n={n} k={k} r={r}: {sass_summary(m, n, k, r)}", flush=True)
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    commit = git_commit()
    peak = DATASHEET_TBPS.get(gpu_tag(), 3.35)
    copy_peak = copy_tbps()
    print(f"device-to-device copy: {copy_peak:.2f} TB/s; datasheet {peak} TB/s", flush=True)
    sweep = sweep_configs(a.sweep)
    rows = [dict(size="-", layer="copy", m=0, impl="torch_copy", lora_r=0, status="ok", tbps=round(copy_peak, 3),
                 commit=commit)]
    for size in a.sizes:
        for name, (slot_rows, k) in SHAPES[size].items():
            if a.layers and name not in a.layers:
                continue
            rows += bench_layer(size, name, slot_rows, k, a.rows, a.impls, a.lora_r, torch.bfloat16, peak,
                                copy_peak, sweep, commit)
            write_result("decode_linear" + a.tag, rows + summarize(rows, a.sizes, peak, commit), a.out_dir)
    summary = summarize(rows, a.sizes, peak, commit)
    for x in summary:
        if x["layer"] == "layer_sum":
            print(f"{x['size']} m={x['m']:3d} {x['impl']:12s} r={x['lora_r']:2d} {x['us']:9.2f} us {x['pct_hbm']:5.1f}% hbm")
        else:
            print(f"{x['size']} m={x['m']:3d} target {x['impl']:24s} {x['value']:8.3f} (target {x['target']}) "
                  f"{'met' if x['met'] else 'MISSED'}")
    print("wrote", write_result("decode_linear" + a.tag, rows + summary, a.out_dir))


if __name__ == "__main__":
    main()
