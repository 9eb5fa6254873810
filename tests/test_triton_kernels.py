"""The Triton NVFP4 kernels (dequantize, split-K sum) and the CUDA dispatch against the float64 truth: on CPU under
TRITON_INTERPRET=1 (small shapes), on GPU at Qwen2.5 shapes (``-m gpu``)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the kernels must be defined in interpreter mode, before their import
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from qerl_trl.nvfp4 import format as F  # noqa: E402
from qerl_trl.nvfp4 import ops  # noqa: E402
from qerl_trl.nvfp4.linear import NVFP4Linear  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
cpu_interp = pytest.mark.skipif(not INTERP, reason="CPU kernel tests need TRITON_INTERPRET=1 (scripts/test.sh sets it)")


def _tk():
    from qerl_trl.nvfp4 import triton_kernels

    return triton_kernels


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _weight(n, k, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.05  # uneven row magnitudes
    return F.quantize(w.to(device))


@cpu_interp
def test_interp_extreme_codes_and_scales():
    """Every E2M1 code (both signs, -0) and FP8 scales from subnormal to 448 dequantize exactly."""
    tk = _tk()
    n, k = 16, 64
    codes = torch.arange(k).remainder(16).to(torch.uint8).repeat(n, 1)
    codes = codes.roll(1, dims=1)
    packed = F.pack_fp4(codes)
    scale_vals = torch.tensor([2.0**-9, 0.125, 0.75, 1.0, 17.0, 240.0, 448.0, 3.0]).repeat(n * 4 // 8 + 1)
    scale = scale_vals[: n * 4].reshape(n, 4).to(torch.float8_e4m3fn)
    gs = torch.tensor([3.7], dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(tk.nvfp4_dequantize(packed, scale, gs, dtype=dtype), F.dequantize(packed, scale, gs, dtype=dtype))


def test_bad_shapes_raise_clear_errors():
    tk = _tk()
    q = _weight(32, 64)
    with pytest.raises(ValueError, match="weight_scale"):
        tk.nvfp4_dequantize(q.weight_packed, q.weight_scale[:, :2], q.weight_global_scale)
    with pytest.raises(ValueError, match="float32 tensor with one element"):
        tk.nvfp4_dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale.double())


def test_backend_registered_and_cpu_keeps_reference():
    assert any(b.name == "triton" for b in ops._BACKENDS)
    q = _weight(32, 64)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert ops.active_backend_name(x, q.weight_packed) == "reference"
    assert _tk().m_bucket(1) == 16 and _tk().m_bucket(65) == 128 and _tk().m_bucket(10**6) == 4096


# ---------------------------------------------------------------------------------------------------- GPU
QWEN_SHAPES = {  # (N, K) of Qwen2.5-7B layers
    "qkv": (4608, 3584),
    "o": (3584, 3584),
    "gate_up": (37888, 3584),
    "down": (3584, 18944),
}


@pytest.mark.gpu
@pytest.mark.parametrize("layer", list(QWEN_SHAPES))
@pytest.mark.parametrize("m,dtype", [(1, torch.bfloat16), (64, torch.bfloat16), (200, torch.bfloat16),
                                     (2048, torch.bfloat16), (7, torch.float16), (300, torch.float16)])
def test_gpu_qwen_shapes(layer, m, dtype):
    """Whatever path the dispatch picks (skinny or dequantize + cuBLAS), at every row bucket."""
    n, k = QWEN_SHAPES[layer]
    q = _weight(n, k, device="cuda", seed=m)
    w = F.dequantize(*q, dtype=torch.float32)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    y = ops.nvfp4_linear_forward(x, *q)
    dx = ops.nvfp4_linear_dgrad(dy, *q)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    tol = 6e-3 if dtype == torch.bfloat16 else 2e-3
    assert _rel(y, x.float() @ w.t()) < tol
    assert _rel(dx, dy.float() @ w) < tol


@pytest.mark.gpu
def test_gpu_nvfp4linear_uses_triton_and_grads_match_reference(monkeypatch):
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 768, bias=True).to("cuda", torch.bfloat16)
    mod = NVFP4Linear.from_linear(lin)
    x = torch.randn(4, 50, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert ops.active_backend_name(x, mod.weight_packed) == "triton"
    y = mod(x)
    (y.float() ** 2).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    monkeypatch.setenv("QERL_NVFP4_BACKEND", "reference")
    y_ref = mod(x)
    (y_ref.float() ** 2).sum().backward()
    assert _rel(y, y_ref) < 6e-3
    assert _rel(gx, x.grad) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 300])
def test_gpu_cuda_graph_capture_after_warmup(m):
    q = _weight(1024, 512, device="cuda")
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    ops.nvfp4_linear_forward(x, *q), ops.nvfp4_linear_dgrad(dy, *q)  # path timing / compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = ops.nvfp4_linear_forward(x, *q)
        dx = ops.nvfp4_linear_dgrad(dy, *q)
    x.copy_(torch.randn_like(x))
    dy.copy_(torch.randn_like(dy))
    q.weight_global_scale.mul_(2.0)  # read through a pointer at replay time, not baked in
    g.replay()
    torch.cuda.synchronize()
    w = F.dequantize(*q, dtype=torch.float32)
    assert _rel(y, x.float() @ w.t()) < 6e-3
    assert _rel(dx, dy.float() @ w) < 6e-3


# ------------------------------------------------------------------------------------- the PTX dequantization
def _run_ptx(asm: str, args: dict[int, int]) -> dict[int, int]:
    """A tiny interpreter for the instructions the dequantization PTX uses (b32 registers, 16-bit halves)."""
    import re

    import numpy as np

    regs = {f"${k}": v for k, v in args.items()}

    def val(tok):
        tok = tok.strip()
        return int(tok, 0) if tok[0].isdigit() else regs[tok]

    def half(bits, fp):  # 16-bit pattern -> python float (subnormals included)
        return float(np.array([bits], dtype=np.uint16).view(np.float16)[0]) if fp == "f16" else \
            float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])

    def to_half(x, fp):  # exact conversion or fail: the recipe must never round
        if fp == "f16":
            bits = int(np.array([x], dtype=np.float16).view(np.uint16)[0])
        else:
            bits = int(np.array([x], dtype=np.float32).view(np.uint32)[0]) >> 16
        assert half(bits, fp) == x, f"{x} is not exact in {fp}"
        return bits

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # split a register into two 16-bit outputs
            lo, hi, src = re.match(r"\{(\S+), (\S+)\}, (\S+)", rest).groups()
            regs[lo], regs[hi] = regs[src] & 0xFFFF, regs[src] >> 16
            continue
        if op == "mov.b32" and "{" in rest:  # pack two 16-bit inputs
            dst, lo, hi = re.match(r"(\S+), \{(\S+), (\S+)\}", rest).groups()
            regs[dst] = (regs[lo] & 0xFFFF) | (regs[hi] & 0xFFFF) << 16
            continue
        ops = [t.strip() for t in rest.split(",")]
        d, a = ops[0], ops[1:]
        if op == "mov.b32":
            regs[d] = val(a[0])
        elif op == "shl.b32":
            regs[d] = (val(a[0]) << val(a[1])) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[d] = val(a[0]) >> val(a[1])
        elif op == "and.b32":
            regs[d] = val(a[0]) & val(a[1])
        elif op == "shf.l.wrap.b32":  # funnel shift of (a[1]:a[0]) left by a[2] mod 32, high word
            lo, hi, n = val(a[0]), val(a[1]), val(a[2]) & 31
            regs[d] = (((hi << 32 | lo) << n) >> 32) & 0xFFFFFFFF
        elif op == "lop3.b32":
            x, y, z, lut = (val(t) for t in a)
            regs[d] = sum(((lut >> ((x >> i & 1) << 2 | (y >> i & 1) << 1 | (z >> i & 1))) & 1) << i for i in range(32))
        elif op == "prmt.b32":
            x, y, sel = val(a[0]), val(a[1]), val(a[2])
            src = x | y << 32
            regs[d] = sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            fp = "bf16" if "bf16" in op else "f16"
            x, y, z = (val(t) for t in a)
            out = 0
            for i in (0, 1):
                r = half(x >> 16 * i & 0xFFFF, fp) * half(y >> 16 * i & 0xFFFF, fp) + half(z >> 16 * i & 0xFFFF, fp)
                out |= to_half(r, fp) << 16 * i
            regs[d] = out
        else:
            raise AssertionError(f"unexpected PTX instruction {op}")
    return {int(k[1:]): v for k, v in regs.items() if k[1:].isdigit() and int(k[1:]) < 16}


@pytest.mark.parametrize("is_bf16", [True, False])
def test_dequant_ptx_recipe_is_exact_for_every_code_and_scale(is_bf16):
    """The inline PTX the GPU kernels use, run instruction by instruction: every E2M1 code in every column
    position, scales from the E4M3 subnormal 2**-9 up to 448, exact products, adjacent columns per register."""
    import numpy as np

    tk = _tk()
    asm = tk._dequant_asm(is_bf16)
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    rng = np.random.default_rng(0)
    for scale in [2.0**-9, 0.001953125 * 3, 0.125, 1.0, 17.0, 240.0, 448.0]:
        s16 = scale * 2.0**119 if is_bf16 else scale  # the scale as the recipe takes it (bf16 pre-shifted)
        s_bits = int(torch.tensor(s16, dtype=torch.bfloat16 if is_bf16 else torch.float16).view(torch.int16)) & 0xFFFF
        for trial in range(20):
            codes = [(trial + j) % 16 for j in range(16)] if trial < 16 else list(rng.integers(0, 16, 16))
            w0 = sum(c << (4 * j) for j, c in enumerate(codes[:8]))
            w1 = sum(c << (4 * j) for j, c in enumerate(codes[8:]))
            out = _run_ptx(asm, {16: w0, 17: w1, 18: s_bits})
            for j, c in enumerate(codes):
                want = (-1.0 if c & 8 else 1.0) * e2m1[c & 7] * scale * (2.0**-7 if is_bf16 else 2.0**-14)
                fp = torch.bfloat16 if is_bf16 else torch.float16
                got = float(torch.tensor([out[j]], dtype=torch.int32).to(torch.int16).view(fp).item())
                assert got == want, (scale, j, c, got, want)


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(16, 64), (37, 80), (5, 16)])
def test_interp_dequantize_kernel_is_bit_identical_to_reference(dtype, n, k):
    tk = _tk()
    q = _weight(n, k, seed=n * k)
    got = tk.nvfp4_dequantize(*q, dtype=dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    assert torch.equal(got, F.dequantize(*q, dtype=dtype))


def _stack(experts: int, n: int, k: int, device: str = "cpu", seed: int = 0):
    """A stack of NVFP4 weights, each expert under its own global scale."""
    qs = [_weight(n, k, device=device, seed=seed + e) for e in range(experts)]
    return (torch.stack([q.weight_packed for q in qs]), torch.stack([q.weight_scale for q in qs]),
            torch.cat([q.weight_global_scale.reshape(1) for q in qs]))  # fmt: skip


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interp_dequantize_stack_is_each_experts_reference_in_one_launch(dtype):
    tk = _tk()
    packed, scale, gs = _stack(3, 37, 80, seed=3)
    got = tk.nvfp4_dequantize_stack(packed, scale, gs, dtype=dtype)
    assert got.shape == (3, 37, 80) and got.dtype == dtype
    for e in range(3):
        assert torch.equal(got[e], F.dequantize(packed[e], scale[e], gs[e : e + 1], dtype=dtype)), e
    with pytest.raises(ValueError, match="one value an expert"):
        tk.nvfp4_dequantize_stack(packed, scale, gs[:2])
    with pytest.raises(ValueError, match="3-D"):
        tk.nvfp4_dequantize_stack(packed[0], scale[0], gs[:1])


@pytest.mark.gpu
def test_gpu_dequantize_stack_bit_identical_at_qwen3_30b_a3b_expert_shapes():
    tk = _tk()
    for n, k in ((1536, 2048), (2048, 768)):  # gate/up and down of an expert
        packed, scale, gs = _stack(8, n, k, device="cuda", seed=n)
        got = tk.nvfp4_dequantize_stack(packed, scale, gs, dtype=torch.bfloat16)
        for e in range(8):
            assert torch.equal(got[e], F.dequantize(packed[e], scale[e], gs[e : e + 1], dtype=torch.bfloat16)), e


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_dequantize_kernel_bit_identical_and_large_m_dispatch(dtype):
    tk = _tk()
    n, k = QWEN_SHAPES["qkv"]
    q = _weight(n, k, device="cuda", seed=11)
    w = F.dequantize(*q, dtype=dtype)
    assert torch.equal(tk.nvfp4_dequantize(*q, dtype=dtype), w)
    m = 65  # beyond the skinny kernel: Triton dequantize + cuBLAS, the same numbers as the reference
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    assert ops.active_backend_name(x, q.weight_packed) == "triton"
    assert ops.triton_path("fwd", x, *q) == ops.triton_path("dgrad", dy, *q) == "dequant_mm"
    assert torch.equal(ops.nvfp4_linear_forward(x, *q), x @ w.t())
    assert torch.equal(ops.nvfp4_linear_dgrad(dy, *q), dy @ w)


@pytest.mark.gpu
def test_gpu_small_m_path_is_timed_once_per_bucket():
    q = _weight(1024, 512, device="cuda", seed=5)
    x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    ops.clear_plans()
    first = ops.triton_path("fwd", x, *q)
    assert first in ("skinny", "dequant_mm") and len(ops._PATHS) == 1
    assert ops.triton_path("fwd", x[:9], *q) == first and len(ops._PATHS) == 1  # same M bucket: cached
    y = ops.nvfp4_linear_forward(x, *q)
    assert _rel(y, x.float() @ F.dequantize(*q, dtype=torch.float32).t()) < 6e-3
    assert ops.triton_path("dgrad", torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16), *q) == "dequant_mm"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sum_splits_adds_the_partials_in_order_and_casts(dtype):
    """The skinny kernel's split-K reduction: one fixed order, so a split matmul is deterministic."""
    tk = _tk()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    parts = (torch.randn(5, 3, 1037, generator=g) * torch.logspace(-3, 3, 1037)).to(dev)
    want = parts[0].clone()
    for s in range(1, 5):
        want += parts[s]
    got = tk.sum_splits(parts, dtype)
    assert got.shape == (3, 1037) and got.dtype == dtype
    if dev == "cuda" or dtype == torch.float32:
        assert torch.equal(got, want.to(dtype))
        assert torch.equal(tk.sum_splits(parts[:1], dtype), parts[0].to(dtype))
    else:  # the interpreter's fp32 -> 16-bit cast truncates instead of rounding to nearest: one ulp apart
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        assert torch.allclose(got.float(), want, rtol=ulp, atol=2.0**-24)  # fp16 subnormals: absolute ulp
    with pytest.raises(ValueError, match="fp32"):
        tk.sum_splits(parts.half(), dtype)
