"""Triton NVFP4 matmuls for the training pass: ``y = x @ Ŵᵀ`` and ``dx = dy @ Ŵ`` straight from the packed weight.

The dense weight Ŵ is never written to global memory: each program loads a tile of ``weight_packed`` (uint8,
two E2M1 codes a byte) and ``weight_scale`` (FP8 E4M3, one per 16 inputs), dequantizes it in registers and feeds
``tl.dot``. The dequantization is exact, with no rounding at all:

* an E2M1 code ``c`` (sign in bit 3) becomes the fp16 bit pattern ``(c & 7) << 9 | (c & 8) << 12``, which *is*
  ``e2m1(c) * 2**-14`` (the code's two exponent bits land in fp16's exponent, 0.5 as an fp16 subnormal);
* an E4M3 scale byte becomes ``((s & 0x7f) << 7 | (s & 0x80) << 8)`` as fp16 = ``scale * 2**-8``, times 256;
* their product ``e2m1 * scale * 2**-14`` has at most 6 significant bits and lies in [2**-24, 0.17], so fp16
  (and bf16, for bf16 activations) holds it exactly;
* the per-tensor factor ``2**14 / weight_global_scale`` is applied once to the fp32 accumulator in the epilogue,
  read through a pointer (no ``.item()``, so no host sync and CUDA-graph safe).

So the kernels compute ``x @ (e2m1 * scale / global)ᵀ`` with exact weights and fp32 accumulation, slightly
*closer* to the fp32 truth than the reference path (which first rounds Ŵ to the activation dtype).

Forward tiles ``[BLOCK_M, BLOCK_N]`` over ``y``; the input gradient tiles ``[BLOCK_M, BLOCK_K]`` over ``dx`` and
reduces over N, optionally split over ``SPLIT`` programs that ``atomic_add`` into an fp32 buffer (used for small
M only, where the weight read dominates and a plain grid would leave SMs idle). Tile configs are autotuned per
``(M bucket, N, K)``: M is bucketed to powers of two (16 ... 4096+) so variable training batch lengths do not
re-tune. Autotuning benchmarks on the first call of each bucket: run one warm-up step before capturing a CUDA
graph. ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors with one fixed config (Triton 3.9's interpreter
computes bf16 ``tl.dot`` wrongly, so there the dot operands are widened to fp32; everything else is identical).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["nvfp4_matmul_fwd", "nvfp4_matmul_dgrad", "supported", "m_bucket"]

_DOT_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def m_bucket(m: int) -> int:
    """Coarse autotune key for the token count: next power of two in [16, 4096]."""
    b = 16
    while b < m and b < 4096:
        b *= 2
    return b


@triton.jit
def _dequant_tile(packed, scale, R: tl.constexpr, C: tl.constexpr):
    """uint8 codes ``[R, C/2]`` + uint8 (E4M3 bits) scales ``[R, C/16]`` -> fp16 ``[R, C]`` = Ŵ * global * 2**-14."""
    codes = tl.join(packed & 0xF, packed >> 4).reshape(R, C)  # even column from the low nibble
    bits = ((codes & 7).to(tl.int16) << 9) | ((codes & 8).to(tl.int16) << 12)
    vals = bits.to(tl.float16, bitcast=True)
    s = ((scale & 0x7F).to(tl.int16) << 7) | ((scale & 0x80).to(tl.int16) << 8)
    s = s.to(tl.float16, bitcast=True) * 256.0
    w = tl.reshape(vals, (R, C // 16, 16)) * s[:, :, None]
    return tl.reshape(w, (R, C))


@triton.jit
def _dequant_gathered(packed, shift, scale):
    """Same values as :func:`_dequant_tile`, elementwise: ``packed``/``scale`` already gathered to ``[R, C]``
    (each byte read for its two columns, each scale for its 16), so no reshape or layout change is needed."""
    codes = (packed >> shift) & 0xF
    bits = ((codes & 7).to(tl.int16) << 9) | ((codes & 8).to(tl.int16) << 12)
    s = ((scale & 0x7F).to(tl.int16) << 7) | ((scale & 0x80).to(tl.int16) << 8)
    return bits.to(tl.float16, bitcast=True) * (s.to(tl.float16, bitcast=True) * 256.0)


@triton.jit
def _fwd_kernel(
    x_ptr, wp_ptr, ws_ptr, gs_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DEQ: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % group) % size_m)
    pid_n = (pid % group) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = rm % M  # wrapped rows/cols are loaded but never stored: no load masks on M/N
    offs_n = rn % N
    offs_k = tl.arange(0, BLOCK_K)
    offs_k2 = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 16)

    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    k_lo = pid_s * k_per
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    if DEQ == 0:
        wp_ptrs = wp_ptr + offs_n[:, None] * (K // 2) + (k_lo // 2 + offs_k2)[None, :]
        ws_ptrs = ws_ptr + offs_n[:, None] * (K // 16) + (k_lo // 16 + offs_ks)[None, :]
    else:
        wp_ptrs = wp_ptr + offs_n[:, None] * (K // 2) + ((k_lo + offs_k) // 2)[None, :]
        ws_ptrs = ws_ptr + offs_n[:, None] * (K // 16) + ((k_lo + offs_k) // 16)[None, :]
        shift = ((offs_k & 1) * 4).to(tl.uint8)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + k_per, K), BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            p = tl.load(wp_ptrs)
            s = tl.load(ws_ptrs)
        else:
            kin = (k0 + offs_k)[None, :] < K
            x = tl.load(x_ptrs, mask=kin, other=0.0)
            if DEQ == 0:
                p = tl.load(wp_ptrs, mask=(k0 // 2 + offs_k2)[None, :] < K // 2, other=0)
                s = tl.load(ws_ptrs, mask=(k0 // 16 + offs_ks)[None, :] < K // 16, other=0)
            else:
                p = tl.load(wp_ptrs, mask=kin, other=0)
                s = tl.load(ws_ptrs, mask=kin, other=0)
        if DEQ == 0:
            w = _dequant_tile(p, s, BLOCK_N, BLOCK_K)
        else:
            w = _dequant_gathered(p, shift, s)
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc)
        x_ptrs += BLOCK_K
        wp_ptrs += BLOCK_K // 2
        ws_ptrs += BLOCK_K // 16

    acc = acc * (16384.0 / tl.load(gs_ptr))
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask, sem="relaxed")


@triton.jit
def _dgrad_kernel(
    dy_ptr, wp_ptr, ws_ptr, gs_ptr, dx_ptr,
    M, N, K, stride_dym, stride_dxm, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DEQ: tl.constexpr = 0,
):
    # dx[M, K] = dy[M, N] @ Ŵ[N, K]; BLOCK_K tiles the output, BLOCK_N is the reduction step.
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_k = tl.cdiv(K, BLOCK_K)
    group = GROUP_M * num_pid_k
    first_m = (pid // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % group) % size_m)
    pid_k = (pid % group) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_m = rm % M
    offs_k2 = (pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)) % (K // 2)  # K % 16 == 0: wraps with rk
    offs_ks = (pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)) % (K // 16)
    offs_n = tl.arange(0, BLOCK_N)

    n_per = tl.cdiv(tl.cdiv(N, BLOCK_N), SPLIT) * BLOCK_N
    n_lo = pid_s * n_per
    dy_ptrs = dy_ptr + offs_m[:, None] * stride_dym + (n_lo + offs_n)[None, :]
    if DEQ == 0:
        wp_ptrs = wp_ptr + (n_lo + offs_n)[:, None] * (K // 2) + offs_k2[None, :]
        ws_ptrs = ws_ptr + (n_lo + offs_n)[:, None] * (K // 16) + offs_ks[None, :]
    else:
        kk = rk % K
        wp_ptrs = wp_ptr + (n_lo + offs_n)[:, None] * (K // 2) + (kk // 2)[None, :]
        ws_ptrs = ws_ptr + (n_lo + offs_n)[:, None] * (K // 16) + (kk // 16)[None, :]
        shift = ((kk & 1) * 4).to(tl.uint8)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n0 in range(n_lo, tl.minimum(n_lo + n_per, N), BLOCK_N):
        if EVEN_N:
            g = tl.load(dy_ptrs)
            p = tl.load(wp_ptrs)
            s = tl.load(ws_ptrs)
        else:
            nmask = (n0 + offs_n) < N
            g = tl.load(dy_ptrs, mask=nmask[None, :], other=0.0)
            p = tl.load(wp_ptrs, mask=nmask[:, None], other=0)
            s = tl.load(ws_ptrs, mask=nmask[:, None], other=0)
        if DEQ == 0:
            w = _dequant_tile(p, s, BLOCK_N, BLOCK_K)
        else:
            w = _dequant_gathered(p, shift, s)
        acc = tl.dot(g.to(DOT_DTYPE), w.to(DOT_DTYPE), acc)
        dy_ptrs += BLOCK_N
        wp_ptrs += BLOCK_N * (K // 2)
        ws_ptrs += BLOCK_N * (K // 16)

    acc = acc * (16384.0 / tl.load(gs_ptr))
    dx_ptrs = dx_ptr + rm[:, None] * stride_dxm + rk[None, :]
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    if SPLIT == 1:
        tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(dx_ptrs, acc, mask=mask, sem="relaxed")


# ----------------------------------------------------------------------------------------------- configs

# DEQ=1 (gathered, reshape-free dequantization) passes the interpreter tests but has not been compiled or timed
# on a GPU yet: opt in with QERL_NVFP4_DEQ_MODES=0,1 to let the autotuner try it.
_DEQ_MODES = tuple(int(v) for v in os.environ.get("QERL_NVFP4_DEQ_MODES", "0").split(","))


def _cfg(bm, bn, bk, warps, stages, split=1, group=8, deq=0):
    return triton.Config(
        dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, SPLIT=split, DEQ=deq), num_warps=warps,
        num_stages=stages,
    )


def _large_configs():
    """M > 64 (compute-bound at training sizes): big tiles so each dequantized weight tile feeds many rows."""
    out = []
    for bm, bn, bk, w, s in [
        (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4),
        (128, 128, 128, 8, 3), (128, 128, 64, 4, 4), (64, 256, 64, 4, 4), (64, 128, 128, 4, 4),
        (256, 128, 128, 8, 3), (128, 256, 128, 8, 3),
    ]:
        out += [_cfg(bm, bn, bk, w, s, deq=d) for d in _DEQ_MODES]
    return out


def _small_fwd_configs():
    """M <= 64 forward: weight-read bound; narrow N tiles so the grid covers every SM, long K steps."""
    out = []
    for bn, bk, w, s in [(32, 256, 4, 4), (64, 256, 4, 4), (32, 512, 4, 3), (64, 128, 4, 5),
                         (128, 128, 4, 4), (16, 512, 4, 4), (32, 128, 4, 6)]:
        for deq in _DEQ_MODES:  # BLOCK_M set from the bucket in the pruner
            out.append(_cfg(16, bn, bk, w, s, group=1, deq=deq))
    return out


def _small_dgrad_configs():
    """M <= 64 input gradient: output is [M, K]; split the N reduction so the grid covers every SM."""
    out = []
    for bk, bn, split, w, s in [(64, 256, 4, 4, 4), (64, 128, 4, 4, 4), (128, 128, 2, 4, 4), (64, 256, 2, 4, 4),
                                (128, 256, 4, 4, 3), (64, 128, 8, 4, 4), (32, 256, 2, 4, 4), (128, 128, 1, 4, 4)]:
        for deq in _DEQ_MODES:
            out.append(_cfg(16, bn, bk, w, s, split=split, group=1, deq=deq))
    return out


def _prune(configs, named_args, **kwargs):
    """Fit BLOCK_M to the M bucket for small M, drop tiles far larger than the problem."""
    mb = named_args["M_BUCKET"]
    n = named_args["N"]
    k = named_args["K"]
    fitted, adapted = [], []
    for c in configs:
        kw = dict(c.kwargs)
        if mb <= 64:
            kw["BLOCK_M"] = mb
        cfg = triton.Config(kw, num_warps=c.num_warps, num_stages=c.num_stages)
        adapted.append(cfg)
        if kw["BLOCK_M"] > mb and mb > 64:
            continue
        if kw["BLOCK_N"] > max(16, triton.next_power_of_2(n)) or kw["BLOCK_K"] > max(16, triton.next_power_of_2(k)):
            continue
        fitted.append(cfg)
    if fitted:
        return fitted
    # Nothing fits a tiny problem: take the config with the smallest shared-memory footprint, never the first
    # (largest) one, which can exceed the SM's shared memory and would be launched untimed.
    return [min(adapted, key=_smem_footprint)]


def _smem_footprint(c) -> int:
    kw = c.kwargs
    return (kw["BLOCK_M"] * kw["BLOCK_K"] + kw["BLOCK_N"] * kw["BLOCK_K"]) * max(1, c.num_stages)


def _even_k(args):
    return args["K"] % args["BLOCK_K"] == 0


def _even_n(args):
    return args["N"] % args["BLOCK_N"] == 0


_KEY = ["M_BUCKET", "N", "K"]  # the autotuner adds the tensors' dtypes itself


def _bench(fn, quantiles):
    # short timing runs: the configs differ by far more than the noise of 25 ms of repeats
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


def _tuned(kernel, configs, even_name, even_fn, reset=None):
    k = triton.heuristics({even_name: even_fn})(kernel)
    kw = dict(configs=configs, key=_KEY, prune_configs_by={"early_config_prune": _prune}, reset_to_zero=reset,
              do_bench=_bench)
    try:  # keep tuned configs on disk across processes (Triton >= 3.2)
        return triton.autotune(cache_results=True, **kw)(k)
    except TypeError:
        return triton.autotune(**kw)(k)


_fwd_large = _tuned(_fwd_kernel, _large_configs(), "EVEN_K", _even_k)
_fwd_small = _tuned(_fwd_kernel, _small_fwd_configs(), "EVEN_K", _even_k)
_dgrad_large = _tuned(_dgrad_kernel, _large_configs(), "EVEN_N", _even_n)
_dgrad_small = _tuned(_dgrad_kernel, _small_dgrad_configs(), "EVEN_N", _even_n, reset=["dx_ptr"])

_INTERP_CFG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)

# ----------------------------------------------------------------------------------------------- entry points


def supported(a: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether these kernels take this call (else ops.py uses the reference path)."""
    if not (a.is_cuda and packed.is_cuda and a.device == packed.device):
        return False
    if a.dtype not in (torch.bfloat16, torch.float16) or packed.dtype != torch.uint8 or packed.ndim != 2:
        return False
    if a.ndim != 2 or a.shape[0] == 0 or (packed.shape[1] * 2) % 16:
        return False
    return torch.cuda.get_device_capability(a.device)[0] >= 8


def _check(a, packed, scale, global_scale, inner):
    if a.shape[-1] != inner:
        raise ValueError(f"NVFP4 matmul: activation has {a.shape[-1]} columns, weight expects {inner}")
    if scale.shape != (packed.shape[0], packed.shape[1] // 8):
        raise ValueError(f"NVFP4 matmul: weight_scale shape {tuple(scale.shape)} does not match weight_packed "
                         f"{tuple(packed.shape)} (expected [out, in/16])")
    if global_scale.numel() != 1 or global_scale.dtype != torch.float32:
        raise ValueError("NVFP4 matmul: weight_global_scale must be a float32 tensor with one element")


def _prep(a, packed, scale):
    if a.stride(-1) != 1:
        a = a.contiguous()
    packed = packed if packed.is_contiguous() else packed.contiguous()
    scale = scale if scale.is_contiguous() else scale.contiguous()
    return a, packed, scale.view(torch.uint8)


def nvfp4_matmul_fwd(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     config: dict | None = None) -> torch.Tensor:
    """``x [M, K] @ Ŵᵀ -> [M, N]`` (x bf16/fp16; fp32 too under the interpreter). ``config`` pins a tile config."""
    M, K = x.shape
    N = packed.shape[0]
    _check(x, packed, scale, global_scale, packed.shape[1] * 2)
    x, packed, scale = _prep(x, packed, scale)
    dot = _DOT_DTYPE[x.dtype]
    if _interpreting():
        config = config or dict(_INTERP_CFG, SPLIT=1)
        dot = tl.float32  # Triton 3.9's interpreter gets bf16 dots wrong
    mb = m_bucket(M)
    if config is not None:
        split = config.get("SPLIT", 1)
        y = torch.zeros(M, N, device=x.device, dtype=torch.float32) if split > 1 else x.new_empty(M, N)
        grid = (triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"]), split)
        extra = {k: v for k, v in config.items() if k in ("num_warps", "num_stages")}
        cfg = {k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}
        cfg.setdefault("GROUP_M", 8)
        cfg.setdefault("SPLIT", 1)
        even = K % cfg["BLOCK_K"] == 0
        _fwd_kernel[grid](x, packed, scale, global_scale, y, M, N, K, x.stride(0), y.stride(0), mb,
                          EVEN_K=even, DOT_DTYPE=dot, **cfg, **extra)
        return y.to(x.dtype) if split > 1 else y
    y = x.new_empty(M, N)
    kern = _fwd_small if mb <= 64 else _fwd_large
    grid = lambda a: (triton.cdiv(M, a["BLOCK_M"]) * triton.cdiv(N, a["BLOCK_N"]), a["SPLIT"])  # noqa: E731
    kern[grid](x, packed, scale, global_scale, y, M, N, K, x.stride(0), y.stride(0), mb, DOT_DTYPE=dot)
    return y


def nvfp4_matmul_dgrad(dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                       config: dict | None = None) -> torch.Tensor:
    """``dy [M, N] @ Ŵ -> [M, K]`` (the input gradient). ``config`` pins a tile config."""
    M, N = dy.shape
    K = packed.shape[1] * 2
    _check(dy, packed, scale, global_scale, packed.shape[0])
    dy, packed, scale = _prep(dy, packed, scale)
    dot = _DOT_DTYPE[dy.dtype]
    if _interpreting():
        config = config or dict(_INTERP_CFG, SPLIT=1)
        dot = tl.float32
    mb = m_bucket(M)
    if config is not None:
        split = config.get("SPLIT", 1)
        dx = torch.zeros(M, K, device=dy.device, dtype=torch.float32) if split > 1 else dy.new_empty(M, K)
        grid = (triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(K, config["BLOCK_K"]), split)
        extra = {k: v for k, v in config.items() if k in ("num_warps", "num_stages")}
        cfg = {k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}
        cfg.setdefault("GROUP_M", 8)
        cfg.setdefault("SPLIT", 1)
        even = N % cfg["BLOCK_N"] == 0
        _dgrad_kernel[grid](dy, packed, scale, global_scale, dx, M, N, K, dy.stride(0), dx.stride(0), mb,
                            EVEN_N=even, DOT_DTYPE=dot, **cfg, **extra)
        return dx.to(dy.dtype) if split > 1 else dx
    grid = lambda a: (triton.cdiv(M, a["BLOCK_M"]) * triton.cdiv(K, a["BLOCK_K"]), a["SPLIT"])  # noqa: E731
    if mb <= 64:  # split-N with fp32 atomics: output is tiny, the weight read is what costs
        dx = torch.zeros(M, K, device=dy.device, dtype=torch.float32)
        _dgrad_small[grid](dy, packed, scale, global_scale, dx, M, N, K, dy.stride(0), dx.stride(0), mb,
                           DOT_DTYPE=dot)
        return dx.to(dy.dtype)
    dx = dy.new_empty(M, K)
    _dgrad_large[grid](dy, packed, scale, global_scale, dx, M, N, K, dy.stride(0), dx.stride(0), mb, DOT_DTYPE=dot)
    return dx
