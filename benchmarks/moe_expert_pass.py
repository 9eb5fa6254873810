"""One MoE layer's routed experts in a training pass, BF16 against NVFP4, at Qwen3-30B-A3B's shapes (issue #54).

    python benchmarks/moe_expert_pass.py [--tokens 2048 8192] [--out-dir benchmarks/results]

Why: the GRPO step of a MoE policy trains through 48 such layers, three passes a micro-batch (forward, the
gradient-checkpointing recompute, backward), and TRL's BF16-LoRA arm runs its experts on transformers 5.17's grouped
GEMM. This measures what QeRL's packed experts cost against that, one layer, the rest of the model left out.

Arms, each a forward then a backward to the hidden states and the routing weights (the experts frozen, as LoRA
training leaves them):

- ``bf16_grouped_mm``: transformers' ``Qwen3MoeExperts`` with its default ``experts_implementation="grouped_mm"``;
- ``bf16_eager``: the same module's per-expert loop;
- ``nvfp4_grouped``: :class:`~qerl_trl.nvfp4.experts.NVFP4Experts` in bf16 (one grouped GEMM a projection over the
  stack dequantized for the call);
- ``nvfp4_loop``: the same module's per-expert NVFP4 matmuls (what it runs without a grouped GEMM).

Routing: top-``k`` of the experts from random logits, so at these token counts every expert is active. Times are
CUDA-event medians of ``--repeats`` calls after warm-up, with min-max; ``peak_gib`` is the pass's peak above what it
started with. ``rel_err`` is the arm's output against ``bf16_grouped_mm``'s (NVFP4's rounding of the weights; the two
NVFP4 arms must agree). Rows go to ``<out-dir>/moe_expert_pass-<gpu>.json``; a failed or OOM arm stays a row with
its status.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import random_models as rm  # noqa: E402
from benchmarks._common import git_commit, write_result  # noqa: E402

ARMS = ("bf16_grouped_mm", "bf16_eager", "nvfp4_grouped", "nvfp4_loop")


def build_experts(experts: int, hidden: int, width: int, device: str, seed: int = 0):
    """``(transformers' BF16 Qwen3MoeExperts, its config, the NVFP4Experts of the same weights)``."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from qerl_trl.nvfp4.experts import NVFP4Experts

    config = rm.qwen3_moe_config("qwen3-30b-a3b", num_hidden_layers=1, num_experts=experts, hidden_size=hidden,
                                 moe_intermediate_size=width)  # fmt: skip
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    bf16 = Qwen3MoeExperts(config).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in bf16.parameters():
            p.normal_(0.0, 0.02)
            p.requires_grad_(False)
    return bf16, config, NVFP4Experts.from_experts(bf16)


def arm_fn(arm: str, bf16, config, nvfp4) -> Callable:
    """The arm's ``f(hidden_states, top_k_index, top_k_weights)``."""
    from qerl_trl.nvfp4 import experts as ex

    if arm.startswith("bf16_"):
        impl = "grouped_mm" if arm == "bf16_grouped_mm" else "eager"

        def run_bf16(x, idx, w):
            config._experts_implementation = impl
            return bf16(x, idx, w)

        return run_bf16
    if arm == "nvfp4_grouped":
        return nvfp4
    usable = ex.grouped_mm_usable

    def run_loop(x, idx, w):
        ex.grouped_mm_usable = lambda t: False
        try:
            return nvfp4(x, idx, w)
        finally:
            ex.grouped_mm_usable = usable

    return run_loop


def _clock(device: str):
    """``(mark, elapsed_ms(a, b))``: CUDA events on the GPU, the host clock elsewhere (the CPU test)."""
    if device == "cuda":

        def mark():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

        def elapsed(a, b):
            b.synchronize()
            return a.elapsed_time(b)

        return mark, elapsed
    return time.perf_counter, lambda a, b: (b - a) * 1e3


def measure(fn: Callable, inputs: tuple, grad: torch.Tensor, repeats: int, warmup: int, device: str) -> dict:
    """Median, min and max of the forward and forward + backward times over ``repeats`` calls; peak memory."""
    mark, elapsed = _clock(device)
    x0, idx, w0 = inputs
    fwd, total = [], []
    peak = None
    for i in range(warmup + repeats):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        if device == "cuda" and i == warmup:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        a = mark()
        y = fn(x, idx, w)
        b = mark()
        y.backward(grad)
        c = mark()
        if device == "cuda" and i == warmup:
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        if i >= warmup:
            fwd.append(elapsed(a, b))
            total.append(elapsed(a, c))
    row = {"fwd_ms": round(statistics.median(fwd), 3), "fwd_bwd_ms": round(statistics.median(total), 3),
           "fwd_bwd_ms_min": round(min(total), 3), "fwd_bwd_ms_max": round(max(total), 3)}  # fmt: skip
    if peak is not None:
        row["peak_gib"] = round(peak, 3)
    return row


def run(tokens: list[int], arms: list[str], experts: int, hidden: int, width: int, top_k: int, repeats: int,
        warmup: int, device: str) -> list[dict]:  # fmt: skip
    """A row per (tokens, arm)."""
    bf16, config, nvfp4 = build_experts(experts, hidden, width, device)
    commit = git_commit()
    rows = []
    for n in tokens:
        gen = torch.Generator(device=device).manual_seed(n)
        x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(n, experts, device=device, generator=gen)
        w, idx = logits.softmax(-1).topk(top_k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
        grad = torch.randn(n, hidden, device=device, dtype=torch.bfloat16, generator=gen)
        with torch.no_grad():
            want = arm_fn("bf16_grouped_mm", bf16, config, nvfp4)(x, idx, w).float()
        for arm in arms:
            base = dict(arm=arm, tokens=n, experts=experts, top_k=top_k, hidden=hidden, width=width, commit=commit)
            try:
                fn = arm_fn(arm, bf16, config, nvfp4)
                with torch.no_grad():
                    got = fn(x, idx, w).float()
                row = dict(base, status="ok", rel_err=round(((got - want).norm() / want.norm()).item(), 5),
                           **measure(fn, (x, idx, w), grad, repeats, warmup, device))  # fmt: skip
            except torch.OutOfMemoryError as e:
                row = dict(base, status=f"oom: {str(e)[:200]}")
            except Exception as e:  # noqa: BLE001 - a failed arm stays a row
                row = dict(base, status=f"failed: {type(e).__name__}: {str(e)[:200]}")
            if device == "cuda":
                torch.cuda.empty_cache()
            print(row, flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="tokens a micro-batch sends")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768, help="an expert's intermediate size")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args(argv)
    rows = run(a.tokens, a.arms, a.experts, a.hidden, a.width, a.top_k, a.repeats, a.warmup, a.device)
    path = write_result("moe_expert_pass", rows, a.out_dir)
    print("wrote", path)
    return path


if __name__ == "__main__":
    main()
