"""Our Triton/Gluon kernels under the JIT hooks other libraries install in the same process.

Triton serializes every compile's constexprs to JSON before calling ``knobs.runtime.jit_cache_hook`` /
``jit_post_compile_hook``; vLLM's worker installs such a hook after its warm-up (``vllm/triton_utils/jit_monitor.py``,
vLLM 0.24). A Gluon layout passed as a constexpr then killed the first training step after the colocated engine
started (``TypeError: Object of type BlockedLayout is not JSON serializable``). CPU: the launcher's check rejects
such a constexpr with a clear error, and every launch site of ours passes the check. GPU: every dispatch path
compiles and runs correctly with a serializing hook installed. ``tests/test_real_shape_colocate.py`` runs a colocate
training step after vLLM's own monitor is active.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from qerl_trl.nvfp4 import format as F  # noqa: E402
from qerl_trl.nvfp4 import ops  # noqa: E402
from qerl_trl.nvfp4._launch import KernelLauncher, check_constexprs_serializable  # noqa: E402


def _weight(n, k, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.quantize((torch.randn(n, k, generator=g) * 0.05).to(device))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_a_gluon_layout_constexpr_is_refused_with_a_clear_error():
    gl = pytest.importorskip("triton.experimental.gluon.language")
    layout = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    with pytest.raises(TypeError, match=r"my_kernel: constexpr X_LAYOUT=.*BlockedLayout.*JIT hooks"):
        check_constexprs_serializable("my_kernel", {"BLOCK": 64, "X_LAYOUT": layout})


def test_plain_constexprs_pass():
    import triton.language as tl

    check_constexprs_serializable("k", {"A": 1, "B": True, "C": 0.5, "D": "s", "E": tl.bfloat16, "F": tl.constexpr(3)})


def test_the_launcher_checks_before_triton_compiles():
    """The check runs on the first call per specialization, before ``kernel[grid]``: a bad constexpr never reaches
    Triton (or a hook), on any machine."""

    class FakeKernel:
        __name__ = "fake_kernel"
        params = None

        def __getitem__(self, grid):
            raise AssertionError("Triton must not be reached")

    launch = KernelLauncher(FakeKernel())
    with pytest.raises(TypeError, match="fake_kernel: constexpr L"):
        launch((1,), (torch.zeros(4),), ("cfg",), {"L": object()})


def test_every_launch_site_passes_serializable_constexprs():
    """The constexprs each of our launch sites passes (skinny forward in every config family, dequantize, split-K
    sum) pass the check."""
    from qerl_trl.nvfp4 import gluon_kernels as gk
    from qerl_trl.nvfp4 import triton_kernels as tk

    for default in (gk._SKINNY_FWD_HOPPER, gk._SKINNY_FWD_MMA):
        block_n, warps, g, _, _, prefetch, wgmma = default
        for is_bf16 in (True, False):
            for split in (1, 7):
                for block_t in (16, 32, 64):
                    key = ("skinny", is_bf16, split, block_n, block_t, g, True, warps, prefetch, wgmma)
                    cx = gk.skinny_constexprs(key)
                    if gk._IMPORT_ERROR is None:  # exactly the kernel's constexpr parameters
                        assert set(cx) == {p.name for p in gk._skinny_fwd_kernel.params if p.is_constexpr}
                    check_constexprs_serializable("skinny", cx)
    check_constexprs_serializable("dequant", dict(tk._DEQUANT_CFG, USE_ASM=True))
    check_constexprs_serializable("sum_splits", dict(SPLIT=3, BLOCK=1024))


# ---------------------------------------------------------------------------------------------------- GPU
def _forget_compiled_kernels():
    """Drop every compiled kernel of ours from Triton's in-memory cache and our launchers, and every dispatch
    decision, so the next calls compile again (from Triton's disk cache: the hooks still run)."""
    from qerl_trl.nvfp4 import gluon_kernels as gk
    from qerl_trl.nvfp4 import triton_kernels as tk

    kernels = [tk._dequant_kernel, tk._sum_splits_kernel]
    launchers = [tk._dequant_launch, tk._sum_splits_launch]
    if gk.available():
        kernels.append(gk._skinny_fwd_kernel)
        launchers.append(gk._skinny_launch)
    for k in kernels:
        k.device_caches.clear()
    for launch in launchers:
        launch.clear()
    ops.clear_plans()


@pytest.mark.gpu
def test_gpu_every_dispatch_path_compiles_under_a_serializing_jit_hook(monkeypatch):
    """As after vLLM's warm-up: JIT hooks installed and autotuning printing on. Forward and input gradient at
    every row bucket (skinny and dequantize + cuBLAS, bf16 and fp16, split-K sums), an NVFP4Linear backward and a
    CUDA-graph capture all compile under the hooks, which parse what Triton serialized, and give right results."""
    from triton import knobs

    from qerl_trl.nvfp4 import gluon_kernels as gk
    from qerl_trl.nvfp4.linear import NVFP4Linear

    seen: list[str] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        json.loads(compile["specialization_data"])
        seen.append(fn.name)
        return False  # False: compile as usual

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", hook)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", hook)
    monkeypatch.setattr(knobs.autotuning, "print", True)
    _forget_compiled_kernels()
    try:
        for dtype in (torch.bfloat16, torch.float16):
            for n, k in ((4608, 3584), (1000, 1040)):
                q = _weight(n, k, device="cuda", seed=n)
                w = F.dequantize(*q, dtype=torch.float32)
                for m in (1, 16, 17, 33, 64, 65, 200, 300, 2048):
                    x = torch.randn(m, k, device="cuda", dtype=dtype)
                    dy = torch.randn(m, n, device="cuda", dtype=dtype)
                    assert _rel(ops.nvfp4_linear_forward(x, *q), x.float() @ w.t()) < 6e-3
                    assert _rel(ops.nvfp4_linear_dgrad(dy, *q), dy.float() @ w) < 6e-3
                if gk.available():  # the skinny kernel itself, whatever the dispatch chose: every config family
                    x = torch.randn(16, k, device="cuda", dtype=dtype)
                    for config in (gk._SKINNY_FWD_HOPPER, gk._SKINNY_FWD_MMA, (64, 4, 4, 0, 8, 1, 0)):
                        if config[-1] and torch.cuda.get_device_capability()[0] != 9:
                            continue
                        assert _rel(gk.nvfp4_matmul_fwd_skinny(x, *q, config=config), x.float() @ w.t()) < 6e-3
        lin = NVFP4Linear.from_linear(torch.nn.Linear(512, 768, bias=False, dtype=torch.bfloat16)).to("cuda")
        x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        lin(x).float().pow(2).sum().backward()
        assert torch.isfinite(x.grad).all()
        xs = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
        lin(xs)  # decide + compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            ys = lin(xs)
        g.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(ys).all()
    finally:
        _forget_compiled_kernels()  # kernels compiled under the test's hooks stay valid, but start clean
    assert "_dequant_kernel" in seen
    if gk.available():
        assert "_skinny_fwd_kernel" in seen and "_sum_splits_kernel" in seen
