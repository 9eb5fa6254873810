"""One NVFP4 decode GEMM launch per Qwen2.5-7B linear, for Nsight Compute (what bounds the kernel) and its SASS.

    ncu --clock-control none --section SpeedOfLight ... python benchmarks/decode_profile.py --m 16
    python benchmarks/decode_profile.py --m 16 --sass-dir DIR     # also writes each kernel's SASS/TTGIR to DIR

The weights are rotated copies (more bytes than L2 holds), as ``decode_linear.py`` times them.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.decode_linear import SHAPES, lora_pair, random_nvfp4  # noqa: E402
from qerl_trl.vllm_plugin import decode_gemm as dg  # noqa: E402
from qerl_trl.vllm_plugin import lora_kernels as lk  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="7b", choices=list(SHAPES))
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--lora-r", type=int, default=0)
    ap.add_argument("--layers", nargs="*", default=None)
    ap.add_argument("--sass-dir", default=None)
    a = ap.parse_args()
    for name, (slot_rows, k) in SHAPES[a.size].items():
        if a.layers and name not in a.layers:
            continue
        n = sum(slot_rows)
        copies = [random_nvfp4(n, k, "cuda") for _ in range(4)]
        x = torch.randn(a.m, k, device="cuda", dtype=torch.bfloat16)
        sems = dg.decode_workspace(n, "cuda")
        lo = lora_pair(slot_rows, k, a.lora_r, "cuda", torch.bfloat16) if a.lora_r else (None, None)
        bounds = lk.lora_slot_bounds([sum(slot_rows[:j]) for j in range(len(slot_rows))], n, "cuda")
        for w in copies * 2:
            dg.nvfp4_lora_linear(x, *w, *lo, bounds if a.lora_r else None, a.lora_r, sems)
        torch.cuda.synchronize()
        print(name, dg.decode_config(a.m, n, k, x.device), flush=True)
    if a.sass_dir:
        os.makedirs(a.sass_dir, exist_ok=True)
        for launch in (dg._gemm_tma_launch, dg._gemm_launch):
            for i, (kernel, _) in enumerate(launch._kernels.values()):
                for kind in ("sass", "ttgir"):
                    with open(os.path.join(a.sass_dir, f"{kernel.name}_{i}.{kind}"), "w") as f:
                        f.write(kernel.asm.get(kind, ""))
                print(kernel.name, i, "regs", kernel.n_regs, "spills", kernel.n_spills, "shared", kernel.metadata.shared)


if __name__ == "__main__":
    main()
