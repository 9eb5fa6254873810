"""The Hopper warp-specialized Gluon kernels (``qerl_trl.nvfp4.gluon_kernels``) against the fp32 truth, the
dispatch that picks them, and their fallbacks. Gluon has no interpreter: the kernel tests need an sm_90 GPU
(``-m gpu``); the CPU tests check that the module stays out of the way where it cannot run."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from qerl_trl.nvfp4 import format as F  # noqa: E402
from qerl_trl.nvfp4 import ops  # noqa: E402
from qerl_trl.nvfp4.linear import NVFP4Linear  # noqa: E402

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


@pytest.mark.parametrize("is_bf16", [True, False])
def test_skinny_dgrad_ptx_recipe_is_exact_for_every_lane_code_and_scale(is_bf16):
    """The skinny input-gradient PTX: lane group ``g`` takes code ``g`` of a word of row ``n`` and of row ``n + 1``
    (rotations ``(12 - 4g) & 31`` and ``+ 16``) and gets both values exactly, each with its own row's scale."""
    import numpy as np

    from test_triton_kernels import _run_ptx

    gk = _gk()
    asm = gk._skinny_dgrad_asm(is_bf16)
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    fp = torch.bfloat16 if is_bf16 else torch.float16
    rng = np.random.default_rng(2)

    def bits(scale):
        return int(torch.tensor(scale * 2.0**119 if is_bf16 else scale, dtype=fp).view(torch.int16)) & 0xFFFF

    for sa, sb in [(2.0**-9, 448.0), (0.125, 1.0), (17.0, 2.0**-9), (448.0, 448.0)]:
        for trial in range(20):
            ca = [(trial + j) % 16 for j in range(8)] if trial < 16 else list(rng.integers(0, 16, 8))
            cb = [(3 * trial + 5 * j) % 16 for j in range(8)] if trial < 16 else list(rng.integers(0, 16, 8))
            wa = sum(int(v) << (4 * j) for j, v in enumerate(ca))
            wb = sum(int(v) << (4 * j) for j, v in enumerate(cb))
            for g in range(8):
                rot = (12 - 4 * g) & 31
                out = _run_ptx(asm, {2: wa, 3: wb, 4: rot, 5: (rot + 16) & 31, 6: bits(sa), 7: bits(sb)})
                for slot, (code, scale) in enumerate(((ca[g], sa), (cb[g], sb))):
                    want = (-1.0 if code & 8 else 1.0) * e2m1[code & 7] * scale * (2.0**-7 if is_bf16 else 2.0**-14)
                    got = float(torch.tensor([out[slot]], dtype=torch.int32).to(torch.int16).view(fp).item())
                    assert got == want, (sa, sb, g, slot, code, got, want)


def test_cpu_module_imports_and_declines():
    """Importing never fails, and the kernels refuse CPU tensors and the interpreter (Triton takes over)."""
    gk = _gk()
    q = _weight(64, 128)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    assert not gk.supported(x, q.weight_packed, q.weight_scale)
    assert not gk.skinny_supported(x, q.weight_packed)
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not gk.available()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 18944), (264, 320)])  # Qwen2.5-7B qkv, down; ragged tiles
@pytest.mark.parametrize("m", [1, 16, 100, 300, 2085])
def test_gpu_ws_fwd_dgrad_match_fp32(dtype, n, k, m):
    gk = _gk()
    q = _weight(n, k, device="cuda", seed=n + k + m)
    w = F.dequantize(*q, dtype=torch.float32)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    assert gk.supported(x, q.weight_packed, q.weight_scale)
    y = gk.nvfp4_matmul_fwd_ws(x, *q)
    dx = gk.nvfp4_matmul_dgrad_ws(dy, *q)
    assert y.shape == (m, n) and y.dtype == dtype and dx.shape == (m, k) and dx.dtype == dtype
    assert _rel(y, x.float() @ w.t()) < TOL[dtype]
    assert _rel(dx, dy.float() @ w) < TOL[dtype]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("config", [(128, 128, 64, 4, 4), (256, 128, 64, 3, 8), (64, 128, 128, 3, 4)])
def test_gpu_ws_every_config_is_exact_to_the_same_bits(config):
    """The weights are exact in every config, so configs differ only by fp32 summation order."""
    gk = _gk()
    q = _weight(1024, 1024, device="cuda", seed=3)
    x = torch.randn(700, 1024, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ F.dequantize(*q, dtype=torch.float32).t()
    assert _rel(gk.nvfp4_matmul_fwd_ws(x, *q, config=config), ref) < TOL[torch.bfloat16]
    assert _rel(gk.nvfp4_matmul_dgrad_ws(x, *q, config=config), x.float() @ F.dequantize(*q, dtype=torch.float32)) \
        < TOL[torch.bfloat16]


@pytest.mark.gpu
@hopper
def test_gpu_unsupported_shapes_fall_back():
    """K not a multiple of 64 (the scales are read four per word): the Triton kernels take the call."""
    gk = _gk()
    q = _weight(256, 96, device="cuda")
    x = torch.randn(300, 96, device="cuda", dtype=torch.bfloat16)
    assert not gk.supported(x, q.weight_packed, q.weight_scale)
    assert "ws" not in ops._candidates("fwd", x, q.weight_packed, q.weight_scale)
    y = ops.nvfp4_linear_forward(x, *q)
    assert _rel(y, x.float() @ F.dequantize(*q, dtype=torch.float32).t()) < TOL[torch.bfloat16]


@pytest.mark.gpu
@hopper
def test_gpu_wrong_activation_width_is_refused_not_read_out_of_bounds():
    gk = _gk()
    q = _weight(256, 512, device="cuda")
    x = torch.randn(8, 320, device="cuda", dtype=torch.bfloat16)
    for fn in (gk.nvfp4_matmul_fwd_skinny, gk.nvfp4_matmul_fwd_ws, gk.nvfp4_matmul_dgrad_ws):
        with pytest.raises(ValueError, match="columns"):
            fn(x, *q)


@pytest.mark.gpu
@hopper
def test_gpu_no_dense_mode_never_writes_w_hat(monkeypatch):
    """QERL_NVFP4_NO_DENSE_WEIGHT=1: dequantize + cuBLAS is never chosen, at any M, and the backward of an
    NVFP4Linear runs without the dense-Ŵ kernel."""
    from qerl_trl.nvfp4 import triton_kernels as tk

    monkeypatch.setenv(ops.NO_DENSE_ENV, "1")
    calls = []
    real = tk.nvfp4_dequantize
    monkeypatch.setattr(tk, "nvfp4_dequantize", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ops._PATHS.clear()
    lin = NVFP4Linear.from_linear(torch.nn.Linear(512, 768, bias=False, dtype=torch.bfloat16)).to("cuda")
    for m in (8, 200, 3000):
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = lin(x)
        y.float().pow(2).sum().backward()
        assert ops.triton_path("fwd", x.detach(), lin.weight_packed, lin.weight_scale, lin.weight_global_scale) \
            != "dequant_mm"
    assert not calls


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
    dy = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="PREFETCH"):
        gk.nvfp4_matmul_fwd_skinny(x, *q, config=(64, 4, 4, 0, 8, 2, 0))
    with pytest.raises(ValueError, match="WGMMA"):
        gk.nvfp4_matmul_fwd_skinny(x, *q, config=(64, 4, 4, 0, 8, 0, 2))
    with pytest.raises(ValueError, match="warp groups"):
        gk.nvfp4_matmul_fwd_skinny(x, *q, config=(64, 2, 4, 0, 8, 0, 1))
    with pytest.raises(ValueError, match="PREFETCH"):
        gk.nvfp4_matmul_dgrad_skinny(dy, *q, config=(4, 2, 1, 0, 8, 2, 0))
    with pytest.raises(ValueError, match="warp groups"):
        gk.nvfp4_matmul_dgrad_skinny(dy, *q, config=(2, 2, 1, 0, 8, 0, 1))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(3584, 3584), (1000, 3584), (3584, 1040), (96, 160)])
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64])
@pytest.mark.parametrize("config", [None, (4, 1, 4), (8, 2, 2, 0, 2), (4, 2, 1, 0, 8, 1, 0), (4, 4, 2, 0, 8, 0, 1),
                                    (8, 2, 1, 0, 4, 1, 1)])
def test_gpu_skinny_dgrad_matches_fp32(dtype, n, k, m, config):
    gk = _gk()
    q = _weight(n, k, device="cuda", seed=n + k + m)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    dx = gk.nvfp4_matmul_dgrad_skinny(dy, *q, config=config)
    assert dx.shape == (m, k) and dx.dtype == dtype
    assert _rel(dx, dy.float() @ F.dequantize(*q, dtype=torch.float32)) < TOL[dtype]


@pytest.mark.gpu
@hopper
def test_gpu_skinny_refuses_too_many_rows_and_dispatch_offers_it_for_both_passes():
    gk = _gk()
    q = _weight(512, 256, device="cuda")
    assert not gk.skinny_supported(torch.randn(65, 256, device="cuda", dtype=torch.bfloat16), q.weight_packed)
    with pytest.raises(ValueError, match="at most 64 rows"):
        gk.nvfp4_matmul_fwd_skinny(torch.randn(65, 256, device="cuda", dtype=torch.bfloat16), *q)
    with pytest.raises(ValueError, match="at most 64 rows"):
        gk.nvfp4_matmul_dgrad_skinny(torch.randn(65, 512, device="cuda", dtype=torch.bfloat16), *q)
    with pytest.raises(ValueError, match="columns"):
        gk.nvfp4_matmul_dgrad_skinny(torch.randn(8, 256, device="cuda", dtype=torch.bfloat16), *q)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    assert ops._candidates("fwd", x, q.weight_packed, q.weight_scale)[0] == "skinny"
    dy = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    assert ops._candidates("dgrad", dy, q.weight_packed, q.weight_scale)[0] == "skinny"
    assert _rel(ops._path_fn("dgrad", "skinny")(dy, *q), dy.float() @ F.dequantize(*q, dtype=torch.float32)) \
        < TOL[torch.bfloat16]


@pytest.mark.gpu
@hopper
def test_gpu_skinny_cuda_graph_capture():
    gk = _gk()
    q = _weight(1024, 4096, device="cuda", seed=4)  # long enough reductions that both passes split
    for fn, a in ((gk.nvfp4_matmul_fwd_skinny, torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)),
                  (gk.nvfp4_matmul_dgrad_skinny, torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16))):
        fn(a, *q)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn(a, *q)
        a.copy_(torch.randn_like(a))
        want = fn(a, *q)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)  # split-K partials are summed in a fixed order: deterministic


@pytest.mark.gpu
@hopper
def test_gpu_ws_cuda_graph_capture():
    gk = _gk()
    q = _weight(1024, 512, device="cuda", seed=9)
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    want = gk.nvfp4_matmul_fwd_ws(x, *q)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = gk.nvfp4_matmul_fwd_ws(x, *q)
    x.copy_(torch.randn_like(x))
    want = gk.nvfp4_matmul_fwd_ws(x, *q)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)
