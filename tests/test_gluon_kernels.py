"""The Gluon decode-shaped forward (``qerl_trl.nvfp4.gluon_kernels``) against the fp32 truth, the dispatch that
picks it, and its fallbacks. Gluon has no interpreter: the kernel tests need a GPU (``-m gpu``; they are written for
the sm_90 machine, where both MMA flavours run); the CPU tests check its PTX exactly and that the module stays out
of the way where it cannot run."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from qerl_trl.nvfp4 import format as F  # noqa: E402
from qerl_trl.nvfp4 import ops  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on sm_90 only")
TOL = {torch.bfloat16: 6e-3, torch.float16: 1e-3}


def _gk():
    from qerl_trl.nvfp4 import gluon_kernels

    return gluon_kernels


def _weight(n, k, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.05
    return F.quantize(w.to(device))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("is_bf16", [True, False])
def test_skinny_ptx_recipe_is_exact_for_every_lane_code_and_scale(is_bf16):
    """The skinny kernel's PTX, run instruction by instruction: lane ``c`` of a quad gets columns 2c, 2c+1 of
    both words of a 16-group, exactly scaled, for every code in every position and scales 2**-9 ... 448."""
    import numpy as np

    from test_triton_kernels import _run_ptx

    gk = _gk()
    asm = gk._skinny_asm(is_bf16)
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    fp = torch.bfloat16 if is_bf16 else torch.float16
    rng = np.random.default_rng(1)
    for scale in [2.0**-9, 0.125, 1.0, 17.0, 448.0]:
        s16 = scale * 2.0**119 if is_bf16 else scale
        s_bits = int(torch.tensor(s16, dtype=fp).view(torch.int16)) & 0xFFFF
        for trial in range(20):
            codes = [(trial + j) % 16 for j in range(16)] if trial < 16 else list(rng.integers(0, 16, 16))
            w0 = sum(int(v) << (4 * j) for j, v in enumerate(codes[:8]))
            w1 = sum(int(v) << (4 * j) for j, v in enumerate(codes[8:]))
            for c in range(4):
                out = _run_ptx(asm, {4: w0, 5: w1, 6: (c << 12) | ((c + 4) << 4), 7: s_bits})
                for slot, col in enumerate((2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c)):
                    code = codes[col]
                    want = (-1.0 if code & 8 else 1.0) * e2m1[code & 7] * scale * (2.0**-7 if is_bf16 else 2.0**-14)
                    got = float(torch.tensor([out[slot]], dtype=torch.int32).to(torch.int16).view(fp).item())
                    assert got == want, (scale, c, col, code, got, want)


def test_cpu_module_imports_and_declines():
    """Importing never fails, and the kernels refuse CPU tensors and the interpreter (Triton takes over)."""
    gk = _gk()
    q = _weight(64, 128)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    assert not gk.skinny_supported(x, q.weight_packed)
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not gk.available()


@pytest.mark.gpu
@hopper
def test_gpu_wrong_activation_width_is_refused_not_read_out_of_bounds():
    gk = _gk()
    q = _weight(256, 512, device="cuda")
    x = torch.randn(8, 320, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="columns"):
        gk.nvfp4_matmul_fwd_skinny(x, *q)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 18944), (264, 320)])
@pytest.mark.parametrize("m", [1, 5, 16, 33, 64])
def test_gpu_skinny_fwd_matches_fp32(dtype, n, k, m):
    gk = _gk()
    q = _weight(n, k, device="cuda", seed=n + k + m)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    assert gk.skinny_supported(x, q.weight_packed)
    y = gk.nvfp4_matmul_fwd_skinny(x, *q)
    assert y.shape == (m, n) and y.dtype == dtype
    assert _rel(y, x.float() @ F.dequantize(*q, dtype=torch.float32).t()) < TOL[dtype]


# (BLOCK_N, warps, G, BLOCK_T, waves, prefetch, wgmma): mma.sync and wgmma, with and without prefetch, 1-2 warp groups
SKINNY_FWD_CONFIGS = [(64, 4, 8, 0, 8, 0, 0), (64, 4, 4, 0, 8, 1, 0), (128, 8, 4, 0, 4, 1, 0), (128, 4, 4, 0, 4, 1, 1),
                      (128, 8, 8, 0, 4, 0, 1)]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(1000, 3584), (3584, 1040), (264, 320)])
@pytest.mark.parametrize("m", [1, 16, 33, 64])
@pytest.mark.parametrize("config", SKINNY_FWD_CONFIGS)
def test_gpu_skinny_fwd_configs_match_fp32(dtype, n, k, m, config):
    """Every MMA flavour and prefetch depth, on ragged shapes (masked loads, split-K tails)."""
    gk = _gk()
    q = _weight(n, k, device="cuda", seed=n + k + m)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    y = gk.nvfp4_matmul_fwd_skinny(x, *q, config=config)
    assert y.shape == (m, n) and y.dtype == dtype
    assert _rel(y, x.float() @ F.dequantize(*q, dtype=torch.float32).t()) < TOL[dtype]


@pytest.mark.gpu
@hopper
def test_gpu_skinny_rejects_bad_configs():
    gk = _gk()
    q = _weight(512, 256, device="cuda")
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="PREFETCH"):
        gk.nvfp4_matmul_fwd_skinny(x, *q, config=(64, 4, 4, 0, 8, 2, 0))
    with pytest.raises(ValueError, match="WGMMA"):
        gk.nvfp4_matmul_fwd_skinny(x, *q, config=(64, 4, 4, 0, 8, 0, 2))
    with pytest.raises(ValueError, match="warp groups"):
        gk.nvfp4_matmul_fwd_skinny(x, *q, config=(64, 2, 4, 0, 8, 0, 1))
    with pytest.raises(ValueError, match="BLOCK_N"):
        gk.nvfp4_matmul_fwd_skinny(x, *q, config=(80, 4, 4, 0, 8, 0, 0))
    with pytest.raises(ValueError, match="BLOCK_T"):
        gk.nvfp4_matmul_fwd_skinny(x, *q, config=(64, 4, 4, 128, 8, 0, 0))


@pytest.mark.gpu
@hopper
def test_gpu_skinny_refuses_too_many_rows_and_dispatch_offers_it_for_the_forward_only():
    gk = _gk()
    q = _weight(512, 256, device="cuda")
    assert not gk.skinny_supported(torch.randn(65, 256, device="cuda", dtype=torch.bfloat16), q.weight_packed)
    with pytest.raises(ValueError, match="at most 64 rows"):
        gk.nvfp4_matmul_fwd_skinny(torch.randn(65, 256, device="cuda", dtype=torch.bfloat16), *q)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    assert ops._candidates("fwd", x, q.weight_packed) == ["skinny", "dequant_mm"]
    dy = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    assert ops._candidates("dgrad", dy, q.weight_packed) == ["dequant_mm"]
    assert ops._candidates("fwd", torch.randn(65, 256, device="cuda", dtype=torch.bfloat16), q.weight_packed) \
        == ["dequant_mm"]


@pytest.mark.gpu
@hopper
def test_gpu_skinny_cuda_graph_capture():
    gk = _gk()
    q = _weight(1024, 4096, device="cuda", seed=4)  # a long enough reduction that the forward splits
    a = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    gk.nvfp4_matmul_fwd_skinny(a, *q)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gk.nvfp4_matmul_fwd_skinny(a, *q)
    a.copy_(torch.randn_like(a))
    want = gk.nvfp4_matmul_fwd_skinny(a, *q)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)  # split-K partials are summed in a fixed order: deterministic
