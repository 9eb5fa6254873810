import os, sys, json, torch, triton
from qerl_trl.nvfp4 import format as F, gluon_kernels as gk, triton_kernels as tk
dev = "cuda"; torch.manual_seed(0)
def rel(a, b): return ((a.float() - b.float()).norm() / b.float().norm()).item()
for (n, k) in [(4608, 3584), (264, 320)]:
    w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16); q = F.quantize(w); wref = F.dequantize(*q, dtype=torch.float32)
    for dt in (torch.bfloat16, torch.float16):
        for m in (20, 33, 64):
            for c in ((128, 4, 4), (256, 8, 4), (256, 4, 8)):
                x = torch.randn(m, k, device=dev, dtype=dt)
                try:
                    y = gk.nvfp4_matmul_fwd_skinny(x, *q, config=c)
                    print(f"ok {dt} {n}x{k} M={m} {c} err {rel(y, x.float() @ wref.t()):.2e}", flush=True)
                except Exception as ex:
                    print(f"FAIL {dt} {n}x{k} M={m} {c}: {type(ex).__name__} {str(ex)[:300]}", flush=True)
shapes = {"7b.qkv": (4608, 3584), "7b.o": (3584, 3584), "7b.gate_up": (37888, 3584), "7b.down": (3584, 18944),
          "32b.qkv": (7168, 5120), "32b.gate_up": (55296, 5120), "32b.down": (5120, 27648)}
cfgs = {1: [(256, 4, 8), (128, 4, 4), (256, 8, 4)],
        16: [(256, 4, 8), (256, 4, 4), (256, 8, 4), (128, 4, 4), (512, 8, 4)],
        32: [(256, 4, 4), (256, 8, 4), (128, 4, 4), (256, 8, 8), (512, 8, 4)],
        64: [(256, 8, 4), (128, 4, 4), (256, 8, 8), (512, 8, 4), (128, 8, 4)]}
for name, (n, k) in shapes.items():
    w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16); q = F.quantize(w)
    for m in (1, 16, 32, 64):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        W = w.t()
        t_bf = triton.testing.do_bench_cudagraph(lambda: x @ W, rep=30)
        row = dict(layer=name, M=m, bf16_graph_ms=round(t_bf, 4))
        for c in cfgs[m]:
            try:
                gk.nvfp4_matmul_fwd_skinny(x, *q, config=c)
                row[str(c)] = round(triton.testing.do_bench_cudagraph(lambda: gk.nvfp4_matmul_fwd_skinny(x, *q, config=c), rep=30) / t_bf, 3)
            except Exception as ex:
                row[str(c)] = f"ERR {type(ex).__name__} {str(ex)[:150]}"
        print(json.dumps(row), flush=True)
