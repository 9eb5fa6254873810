"""Triton NVFP4 kernels for the training pass: fused ``y = x @ Ŵᵀ`` / ``dx = dy @ Ŵ`` and a one-pass dequantize.

The fused kernels never write the dense weight Ŵ to global memory: each program loads ``weight_packed`` as int32
words (8 E2M1 codes each) and ``weight_scale`` (FP8 E4M3, one per 16 inputs), dequantizes in registers and feeds
``tl.dot``. The dequantization is exact, with no rounding at all:

* inline PTX (:func:`_dequant_asm`, the Marlin trick) turns two columns per instruction into 16-bit floats:
  keeping a code's sign bit and shifting its three magnitude bits to the exponent/mantissa boundary gives
  ``e2m1 * 2**-126`` as bf16 (or ``e2m1 * 2**-14`` as fp16), 0.5 becoming a subnormal;
* one ``fma`` per pair multiplies by the scale, pre-shifted to ``scale * 2**119`` (bf16) or ``scale`` (fp16), so
  the product ``e2m1 * scale`` times ``2**-7`` / ``2**-14`` (at most 6 significant bits, always a normal or an
  exact subnormal) is held exactly;
* the per-tensor factor ``2**7`` (or ``2**14``) ``/ weight_global_scale`` is applied once to the fp32 accumulator,
  read through a pointer (no ``.item()``, so no host sync and CUDA-graph safe).

So the kernels compute ``x @ (e2m1 * scale / global)ᵀ`` with exact weights and fp32 accumulation, slightly
*closer* to the fp32 truth than the reference path (which first rounds Ŵ to the activation dtype). The 16
columns of each group are put in order by ``tl.join`` and one reshape, which only add and merge register-only
dimensions, so no data moves between threads.

Why the fused kernels are only a candidate for small M (``qerl_trl.nvfp4.ops`` times them against
``gluon_kernels``' warp-specialized Hopper kernels and dequantize + cuBLAS): Triton 3.6 stages a
register-computed MMA operand through shared memory and waits for each wgmma before writing the next tile, so
dequantization and the tensor cores never overlap on Hopper. Measured on an H200, that costs 2.5-4.2x cuBLAS
at >= 2048 rows (benchmarks/results/train_matmul-h200.json), with ~3 instructions per weight. The same loop with a
plain bf16 weight passed through registers already costs 1.5-2.5x, against 1.2-1.8x when the weight is loaded
straight into shared memory (benchmarks/results/fused_structure-h200.json). Above the fused range,
:func:`nvfp4_dequantize` writes Ŵ once (memory-bound, bit-identical to ``format.dequantize``) and cuBLAS runs the
matmul, which is within 1.0-1.16x of BF16 there.

Forward tiles ``[BLOCK_M, BLOCK_N]`` over ``y``; the input gradient tiles ``[BLOCK_M, BLOCK_K]`` over ``dx`` and
reduces over N, for small M split over ``SPLIT`` programs that ``atomic_add`` into an fp32 buffer (the forward
kernel takes ``SPLIT`` too, but only a pinned ``config`` uses it: unsplit tiles were faster). Tile configs
are autotuned per ``(M bucket, N, K)``: M is bucketed to powers of two (16 ... 4096+) so variable training batch
lengths do not re-tune. Autotuning benchmarks on the first call of each bucket: run one warm-up step before
capturing a CUDA graph. ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors with one fixed config and a
portable fp32 dequantization instead of the PTX (which ``tests/test_triton_kernels.py`` checks separately, with a
small PTX interpreter); Triton 3.9's interpreter computes bf16 ``tl.dot`` wrongly, so there the dot is fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._launch import KernelLauncher

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


def _dequant_asm(is_bf16: bool, words: int = 2, pairs: bool = False) -> str:
    """PTX turning two int32 words (16 E2M1 codes, column ``c`` in bits ``4c..4c+3`` of word ``c // 8``) and their
    16-bit scale into 16 scaled 16-bit floats, two columns per instruction (the Marlin trick, adapted so each
    output register holds *adjacent* columns and no repacking is needed):

    ``u = q << 4`` puts code ``2b`` in the high nibble of ``u``'s byte ``b``, where ``q``'s byte ``b`` already holds
    code ``2b+1``; ``prmt`` moves those two bytes to bytes 1 and 3, so both codes sit in the top nibble of a
    16-bit half. Keeping the sign bit and shifting the 3 magnitude bits down into the exponent/mantissa boundary
    gives ``e2m1 * 2**-126`` (bf16) or ``e2m1 * 2**-14`` (fp16) exactly (0.5 becomes a subnormal), and one
    ``fma`` per pair applies the scale.

    ``pairs=True`` returns each register whole (``4 * words`` 32-bit outputs, columns ``2j`` and ``2j+1`` in the
    low and high half of output ``j``) instead of 16-bit halves, so a kernel that stores the pairs to shared
    memory as 32-bit words needs no repacking moves.
    """
    n_out = 4 * words if pairs else 8 * words  # operands: outputs, then the words, then the 16-bit scale
    scale = f"${n_out + words}"
    lines = ["{", ".reg .b32 u, t, m, o, s2, z;", f"mov.b32 s2, {{{scale}, {scale}}};", "mov.b32 z, 0x80008000;"]
    for wi, reg in enumerate(f"${n_out + i}" for i in range(words)):
        lines.append(f"shl.b32 u, {reg}, 4;")
        for b in range(4):
            lines += _pair_ptx(reg, hex((b << 12) | ((4 + b) << 4)), is_bf16)
            lines.append(f"mov.b32 ${4 * wi + b}, o;" if pairs
                         else f"mov.b32 {{${8 * wi + 2 * b}, ${8 * wi + 2 * b + 1}}}, o;")
    lines.append("}")
    return "\n".join(lines)


def _pair_ptx(word: str, sel: str, is_bf16: bool) -> list[str]:
    """The core of :func:`_dequant_asm`: with ``u = word << 4`` already in ``u``, byte ``b`` of ``word`` (selector
    ``sel = (b << 12) | ((4 + b) << 4)``, a literal or a register) -> register ``o`` holding its two columns as
    16-bit floats times the scale pair ``s2`` (``z`` = -0.0 pair)."""
    sh, mag = (6, "0x01C001C0") if is_bf16 else (3, "0x0E000E00")
    fma = "fma.rn.bf16x2" if is_bf16 else "fma.rn.f16x2"
    return [f"prmt.b32 t, {word}, u, {sel};",  # byte 1 <- u[b], byte 3 <- word[b]
            f"shr.b32 m, t, {sh};", f"and.b32 m, m, {mag};",
            "lop3.b32 t, t, 0x80008000, m, 0xEA;",  # (t & sign) | m
            f"{fma} o, t, s2, z;"]  # * scale (+ -0.0 keeps the product's sign and exactness)


_ASM_BF16 = tl.constexpr(_dequant_asm(True))
_ASM_F16 = tl.constexpr(_dequant_asm(False))
_ASM_F16_WORD = tl.constexpr(_dequant_asm(False, words=1))


@triton.jit
def _scale_16bit(s, IS_BF16: tl.constexpr):
    """E4M3 scale bytes -> ``scale * 2**119`` (bf16) or ``scale`` (fp16), exactly, on any GPU (no fp8 cvt)."""
    bits = ((s & 0x7F).to(tl.int16) << 7) | ((s & 0x80).to(tl.int16) << 8)
    sf = bits.to(tl.float16, bitcast=True).to(tl.float32)  # scale * 2**-8 (E4M3 subnormals -> fp16 subnormals)
    if IS_BF16:
        return (sf * 2.0**127).to(tl.bfloat16)
    else:
        return (sf * 256.0).to(tl.float16)


@triton.jit
def _code_value(w, SHIFT: tl.constexpr):
    """E2M1 code at bits ``[SHIFT, SHIFT + 4)`` of int32 words -> its fp32 value (portable path)."""
    c = w >> SHIFT
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _join16(o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, o12, o13, o14, o15):
    """16 ``[R, G]`` tensors (column j of each 16-group) -> ``[R, 16 G]``. Column j = 8*i3 + 4*i2 + 2*i1 + i0 and
    tl.join appends the fastest dimension, so the slowest index is joined first; the joins only add
    register-only dimensions and the reshape merges them, so no data moves between threads."""
    h = tl.join(tl.join(tl.join(tl.join(o0, o8), tl.join(o4, o12)), tl.join(tl.join(o2, o10), tl.join(o6, o14))),
                tl.join(tl.join(tl.join(o1, o9), tl.join(o5, o13)), tl.join(tl.join(o3, o11), tl.join(o7, o15))))
    return tl.reshape(h, (o0.shape[0], o0.shape[1] * 16))


@triton.jit
def _dequant_f32(w0, w1, sf):
    """Portable path: ``e2m1(code) * sf`` in fp32, ``sf`` the per-group multiplier ``[R, G]``."""
    return _join16(_code_value(w0, 0) * sf, _code_value(w0, 4) * sf, _code_value(w0, 8) * sf,
                   _code_value(w0, 12) * sf, _code_value(w0, 16) * sf, _code_value(w0, 20) * sf,
                   _code_value(w0, 24) * sf, _code_value(w0, 28) * sf, _code_value(w1, 0) * sf,
                   _code_value(w1, 4) * sf, _code_value(w1, 8) * sf, _code_value(w1, 12) * sf,
                   _code_value(w1, 16) * sf, _code_value(w1, 20) * sf, _code_value(w1, 24) * sf,
                   _code_value(w1, 28) * sf)


@triton.jit
def _dequant(w0, w1, s, IS_BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """Words ``w0`` (columns 0-7 of each 16-group), ``w1`` (8-15) and scale bytes ``s``, all ``[R, G]`` ->
    ``[R, 16 G]`` = Ŵ * global * 2**-7 (bf16) or * 2**-14 (fp16); fp32 on the portable path (interpreter)."""
    if USE_ASM:
        sc = _scale_16bit(s, IS_BF16)
        if IS_BF16:
            o = tl.inline_asm_elementwise(_ASM_BF16, "=h," * 16 + "r,r,h", [w0, w1, sc], dtype=(tl.bfloat16,) * 16,
                                          is_pure=True, pack=1)
        else:
            o = tl.inline_asm_elementwise(_ASM_F16, "=h," * 16 + "r,r,h", [w0, w1, sc], dtype=(tl.float16,) * 16,
                                          is_pure=True, pack=1)
        return _join16(*o)
    else:
        sf = _scale_16bit(s, False).to(tl.float32)
        if IS_BF16:
            sf = sf * 0.0078125
        else:
            sf = sf * 0.00006103515625
        return _dequant_f32(w0, w1, sf)


@triton.jit
def _col(o, eff, dtype: tl.constexpr):
    """One column of :func:`_dequant_kernel`'s PTX path: ``(e2m1 * 2**-14) * (scale / global * 2**14)`` in fp32,
    which is the reference's ``e2m1 * (scale / global)`` exactly (the powers of two cancel, no extra rounding),
    then rounded once to ``dtype``."""
    return (o.to(tl.float32) * eff).to(dtype)


@triton.jit
def _dequant_rows(wq_ptr, ws_ptr, gs_ptr, out_ptr, N, K, row0, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                  USE_ASM: tl.constexpr):
    W: tl.constexpr = BLOCK_C // 8
    rows = row0 + tl.arange(0, BLOCK_R)
    word = tl.program_id(1) * W + tl.arange(0, W)
    mask = (rows < N)[:, None] & (word < K // 8)[None, :]
    q = tl.load(wq_ptr + rows[:, None] * (K // 8) + word[None, :], mask=mask, other=0)
    s = tl.load(ws_ptr + rows[:, None] * (K // 16) + (word // 2)[None, :], mask=mask, other=0)
    eff = _scale_16bit(s, False).to(tl.float32) / tl.load(gs_ptr)
    od = out_ptr.dtype.element_ty
    if USE_ASM:  # the PTX with a unit scale gives e2m1 * 2**-14 as fp16, two columns per instruction
        o = tl.inline_asm_elementwise(_ASM_F16_WORD, "=h," * 8 + "r,h", [q, tl.full(q.shape, 1.0, tl.float16)],
                                      dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        e = eff * 16384.0
        c0, c1, c2, c3 = _col(o[0], e, od), _col(o[1], e, od), _col(o[2], e, od), _col(o[3], e, od)
        c4, c5, c6, c7 = _col(o[4], e, od), _col(o[5], e, od), _col(o[6], e, od), _col(o[7], e, od)
    else:
        c0, c1 = _code_value(q, 0) * eff, _code_value(q, 4) * eff
        c2, c3 = _code_value(q, 8) * eff, _code_value(q, 12) * eff
        c4, c5 = _code_value(q, 16) * eff, _code_value(q, 20) * eff
        c6, c7 = _code_value(q, 24) * eff, _code_value(q, 28) * eff
    # column j = 4*i2 + 2*i1 + i0: join the slowest index first (see _join16)
    w = tl.reshape(tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7))),
                   (BLOCK_R, BLOCK_C))
    if not USE_ASM:
        if od == tl.bfloat16:  # round to nearest even by hand: the interpreter truncates
            bits = w.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            w = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            w = w.to(od)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], w, mask=(rows < N)[:, None] & (cols < K)[None, :])


@triton.jit
def _dequant_kernel(wq_ptr, ws_ptr, gs_ptr, out_ptr, N, K, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                    ROW_STEPS: tl.constexpr, USE_ASM: tl.constexpr):
    """Dense ``Ŵ [N, K]`` in the output dtype, bit-identical to :func:`qerl_trl.nvfp4.format.dequantize`
    (``e2m1 * (scale / global)`` in fp32, rounded once). For the large-M path: one memory-bound pass, then
    cuBLAS. Works per 32-bit word (8 columns, 16 bytes of output); each program covers ``BLOCK_R`` rows of
    ``BLOCK_C`` columns and walks ``ROW_STEPS`` such row blocks."""
    for step in range(ROW_STEPS):
        _dequant_rows(wq_ptr, ws_ptr, gs_ptr, out_ptr, N, K, (tl.program_id(0) * ROW_STEPS + step) * BLOCK_R,
                      BLOCK_R, BLOCK_C, USE_ASM)


@triton.jit
def _opaque(w):
    """Identity the compiler cannot see through (free after ptxas): Triton 3.6's OptimizeDotOperands otherwise
    folds the dequantization's reshape into a shared-memory view that it cannot build for the input-gradient's
    [BLOCK_N, BLOCK_K] operand ("Illegal shared layout")."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [w], dtype=w.dtype, is_pure=True, pack=2)


@triton.jit
def _fwd_kernel(
    x_ptr, wq_ptr, ws_ptr, gs_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, IS_BF16: tl.constexpr,
    USE_ASM: tl.constexpr,
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

    G: tl.constexpr = BLOCK_K // 16
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = rm % M  # wrapped rows/cols are loaded but never stored: no load masks on M/N
    offs_n = rn % N
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, G)

    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    k_lo = pid_s * k_per
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = wq_ptr + offs_n[:, None] * (K // 8) + (k_lo // 8 + 2 * offs_g)[None, :]
    s_ptrs = ws_ptr + offs_n[:, None] * (K // 16) + (k_lo // 16 + offs_g)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + k_per, K), BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w0 = tl.load(w_ptrs)
            w1 = tl.load(w_ptrs + 1)
            s = tl.load(s_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)
            gin = (k0 // 16 + offs_g)[None, :] < K // 16
            w0 = tl.load(w_ptrs, mask=gin, other=0)
            w1 = tl.load(w_ptrs + 1, mask=gin, other=0)
            s = tl.load(s_ptrs, mask=gin, other=0)
        w = _dequant(w0, w1, s, IS_BF16, USE_ASM)
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8
        s_ptrs += BLOCK_K // 16

    if IS_BF16:
        acc = acc * (128.0 / tl.load(gs_ptr))
    else:
        acc = acc * (16384.0 / tl.load(gs_ptr))
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask, sem="relaxed")


@triton.jit
def _dgrad_kernel(
    dy_ptr, wq_ptr, ws_ptr, gs_ptr, dx_ptr,
    M, N, K, stride_dym, stride_dxm, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_N: tl.constexpr, DOT_DTYPE: tl.constexpr, IS_BF16: tl.constexpr,
    USE_ASM: tl.constexpr,
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

    G: tl.constexpr = BLOCK_K // 16
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_m = rm % M
    offs_g = (pid_k * G + tl.arange(0, G)) % (K // 16)  # K % 16 == 0: wraps together with rk
    offs_n = tl.arange(0, BLOCK_N)

    n_per = tl.cdiv(tl.cdiv(N, BLOCK_N), SPLIT) * BLOCK_N
    n_lo = pid_s * n_per
    dy_ptrs = dy_ptr + offs_m[:, None] * stride_dym + (n_lo + offs_n)[None, :]
    w_ptrs = wq_ptr + (n_lo + offs_n)[:, None] * (K // 8) + (2 * offs_g)[None, :]
    s_ptrs = ws_ptr + (n_lo + offs_n)[:, None] * (K // 16) + offs_g[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n0 in range(n_lo, tl.minimum(n_lo + n_per, N), BLOCK_N):
        if EVEN_N:
            g = tl.load(dy_ptrs)
            w0 = tl.load(w_ptrs)
            w1 = tl.load(w_ptrs + 1)
            s = tl.load(s_ptrs)
        else:
            nin = (n0 + offs_n) < N
            g = tl.load(dy_ptrs, mask=nin[None, :], other=0.0)
            w0 = tl.load(w_ptrs, mask=nin[:, None], other=0)
            w1 = tl.load(w_ptrs + 1, mask=nin[:, None], other=0)
            s = tl.load(s_ptrs, mask=nin[:, None], other=0)
        w = _dequant(w0, w1, s, IS_BF16, USE_ASM)
        if USE_ASM:
            w = _opaque(w)
        acc = tl.dot(g.to(DOT_DTYPE), w.to(DOT_DTYPE), acc)
        dy_ptrs += BLOCK_N
        w_ptrs += BLOCK_N * (K // 8)
        s_ptrs += BLOCK_N * (K // 16)

    if IS_BF16:
        acc = acc * (128.0 / tl.load(gs_ptr))
    else:
        acc = acc * (16384.0 / tl.load(gs_ptr))
    dx_ptrs = dx_ptr + rm[:, None] * stride_dxm + rk[None, :]
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    if SPLIT == 1:
        tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(dx_ptrs, acc, mask=mask, sem="relaxed")


# ----------------------------------------------------------------------------------------------- configs

def _cfg(bm, bn, bk, warps, stages, split=1, group=8):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, SPLIT=split), num_warps=warps,
                         num_stages=stages)


# (BLOCK_M, weight tile rows, weight tile columns, warps, stages) for M > 64: the tensor cores bound the time,
# so BLOCK_M is what amortizes the dequantization (each weight element costs ~3 instructions once per tile).
_LARGE = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
          (128, 128, 128, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 256, 64, 4, 3),
          (256, 128, 32, 8, 4), (128, 256, 32, 8, 4)]


def _large_configs():
    """Forward: the weight tile is ``[BLOCK_N, BLOCK_K]`` (N rows, K columns)."""
    return [_cfg(bm, rows, cols, w, s) for bm, rows, cols, w, s in _LARGE]


def _large_dgrad_configs():
    """Input gradient: the weight tile is ``[BLOCK_N, BLOCK_K]`` too, but BLOCK_K tiles the output."""
    return [_cfg(bm, cols, rows, w, s) for bm, rows, cols, w, s in _LARGE]


def _small_fwd_configs():
    """M <= 64 forward: weight-read bound; narrow N tiles (the grid covers every SM without splitting K, which
    would cost an fp32 buffer, atomics and a cast kernel), long K steps."""
    return [_cfg(16, bn, bk, w, s, group=1)  # BLOCK_M is set from the bucket in the pruner
            for bn, bk, w, s in [(32, 256, 4, 4), (64, 256, 4, 4), (32, 512, 4, 3), (64, 128, 4, 5),
                                 (128, 128, 4, 4), (16, 512, 4, 4), (32, 128, 4, 6), (64, 512, 4, 3)]]


def _small_dgrad_configs():
    """M <= 64 input gradient: output is [M, K]; split the N reduction so the grid covers every SM."""
    return [_cfg(16, bn, bk, w, s, split=sp, group=1)
            for bk, bn, sp, w, s in [(64, 256, 4, 4, 4), (64, 128, 4, 4, 4), (128, 128, 2, 4, 4), (64, 256, 2, 4, 4),
                                     (128, 256, 4, 4, 3), (64, 128, 8, 4, 4), (32, 256, 2, 4, 4), (128, 128, 1, 4, 4),
                                     (128, 64, 4, 4, 4), (256, 64, 2, 4, 4)]]


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
_dgrad_large = _tuned(_dgrad_kernel, _large_dgrad_configs(), "EVEN_N", _even_n)
_dgrad_small = _tuned(_dgrad_kernel, _small_dgrad_configs(), "EVEN_N", _even_n, reset=["dx_ptr"])

_INTERP_CFG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)
#: One fixed config for the dequantize pass. It is memory-bound, and what limits it is bytes in flight per SM:
#: 1024 columns per row (four words, one 16-byte load per thread) and 8 rows per program beat the earlier
#: default 256-column config by 8-13% on six Qwen shapes on an H200 (2.4-3.5 TB/s) and rank first among 8 configs
#: on five of them, within 3% on the sixth (benchmarks/results/launch_overhead-h200.json, part "dequant"). Fixed
#: rather than autotuned so the launch skips the autotuner's per-call Python.
@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """``out = partials[0] + ... + partials[SPLIT - 1]`` in that order (fp32), cast to ``out``'s dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_sum_splits_launch = KernelLauncher(_sum_splits_kernel)


def sum_splits(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[split, *shape]`` fp32 partial sums of a split-K matmul -> their sum ``[*shape]`` in ``dtype``.

    One launch replaces zero-filling an fp32 output, adding the splits into it atomically and casting it (three
    launches), and the fixed summation order makes the result deterministic."""
    if partials.dtype != torch.float32 or not partials.is_contiguous() or partials.dim() < 2:
        raise ValueError(f"sum_splits takes contiguous fp32 [split, ...] partials, got {partials.dtype} "
                         f"{tuple(partials.shape)}")
    split = partials.shape[0]
    out = partials.new_empty(partials.shape[1:], dtype=dtype)
    numel = out.numel()
    if numel:
        _sum_splits_launch((triton.cdiv(numel, 1024),), (partials, out, numel), ("sum", split),
                           dict(SPLIT=split, BLOCK=1024), dict(num_warps=4))
    return out


_DEQUANT_CFG = dict(BLOCK_R=8, BLOCK_C=1024, ROW_STEPS=1)
_DEQUANT_WARPS = 4
_dequant_launch = KernelLauncher(_dequant_kernel)

# ----------------------------------------------------------------------------------------------- entry points


_CAPABILITY: dict[int, tuple[int, int]] = {}


def supported(a: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether these kernels take this call (else ops.py uses the reference path)."""
    if not (a.is_cuda and packed.is_cuda and a.device == packed.device):
        return False
    if a.dtype not in (torch.bfloat16, torch.float16) or packed.dtype != torch.uint8 or packed.ndim != 2:
        return False
    if a.ndim != 2 or a.shape[0] == 0 or (packed.shape[1] * 2) % 16:
        return False
    idx = a.device.index if a.device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:  # asked once per device: this runs on every matmul
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx][0] >= 8


def _check(a, packed, scale, global_scale, inner):
    if a is not None and a.shape[-1] != inner:
        raise ValueError(f"NVFP4 matmul: activation has {a.shape[-1]} columns, weight expects {inner}")
    if scale.shape != (packed.shape[0], packed.shape[1] // 8):
        raise ValueError(f"NVFP4 matmul: weight_scale shape {tuple(scale.shape)} does not match weight_packed "
                         f"{tuple(packed.shape)} (expected [out, in/16])")
    if global_scale.numel() != 1 or global_scale.dtype != torch.float32:
        raise ValueError("NVFP4 matmul: weight_global_scale must be a float32 tensor with one element")


def _prep(a, packed, scale):
    """Contiguous operands; the packed weight viewed as int32 words (8 codes each, K % 16 == 0 so rows align)."""
    if a is not None and a.stride(-1) != 1:
        a = a.contiguous()
    packed = packed if packed.is_contiguous() else packed.contiguous()
    if packed.data_ptr() % 4:  # a sliced storage; the kernels read whole 32-bit words
        packed = packed.clone()
    scale = scale if scale.is_contiguous() else scale.contiguous()
    return a, packed.view(torch.int32), scale.view(torch.uint8)


def _flags(a):
    """Constexprs shared by both kernels: dot dtype, which 16-bit float the weight is built in, inline PTX or not."""
    if _interpreting():  # no inline PTX, and Triton 3.9's interpreter gets bf16 dots wrong: exact fp32 instead
        return dict(DOT_DTYPE=tl.float32, IS_BF16=a.dtype == torch.bfloat16, USE_ASM=False)
    return dict(DOT_DTYPE=_DOT_DTYPE[a.dtype], IS_BF16=a.dtype == torch.bfloat16, USE_ASM=True)


def _launch_pinned(kernel, a, wq, scale, global_scale, out_shape, config, even_name, even_fn, tile_n):
    """Run ``kernel`` with one given tile config (tests, the interpreter) instead of the autotuner."""
    M = a.shape[0]
    split = config.get("SPLIT", 1)
    out = torch.zeros(out_shape, device=a.device, dtype=torch.float32) if split > 1 else a.new_empty(out_shape)
    extra = {k: v for k, v in config.items() if k in ("num_warps", "num_stages")}
    cfg = {k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}
    cfg.setdefault("GROUP_M", 8)
    cfg.setdefault("SPLIT", 1)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(out_shape[1], cfg[tile_n]), split)
    kernel[grid](a, wq, scale, global_scale, out, M, wq.shape[0], wq.shape[1] * 8, a.stride(0), out.stride(0),
                 m_bucket(M), **{even_name: even_fn(cfg)}, **_flags(a), **cfg, **extra)
    return out.to(a.dtype) if split > 1 else out


def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense ``Ŵ [N, K]`` of ``dtype`` in one kernel (bit-identical to ``format.dequantize``); the large-M
    matmuls dequantize this way and hand Ŵ to cuBLAS, where the tensor cores, not the weight read, set the time."""
    N, K = packed.shape[0], packed.shape[1] * 2
    if K % 16:
        raise ValueError(f"NVFP4 dequantize: in_features {K} is not a multiple of 16")
    _check(None, packed, scale, global_scale, K)
    _, wq, scale = _prep(None, packed, scale)
    out = torch.empty(N, K, device=packed.device, dtype=dtype)
    if _interpreting():
        grid = (triton.cdiv(N, 8), triton.cdiv(K, 64))
        _dequant_kernel[grid](wq, scale, global_scale, out, N, K, BLOCK_R=4, BLOCK_C=64, ROW_STEPS=2, USE_ASM=False)
    else:
        use_asm = dtype != torch.float32
        rows = _DEQUANT_CFG["BLOCK_R"] * _DEQUANT_CFG["ROW_STEPS"]
        grid = (triton.cdiv(N, rows), triton.cdiv(K, _DEQUANT_CFG["BLOCK_C"]))
        _dequant_launch(grid, (wq, scale, global_scale, out, N, K), use_asm, dict(_DEQUANT_CFG, USE_ASM=use_asm),
                        dict(num_warps=_DEQUANT_WARPS))
    return out


def nvfp4_matmul_fwd(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     config: dict | None = None) -> torch.Tensor:
    """``x [M, K] @ Ŵᵀ -> [M, N]`` (x bf16/fp16; fp32 too under the interpreter). ``config`` pins a tile config."""
    M, K = x.shape
    N = packed.shape[0]
    _check(x, packed, scale, global_scale, packed.shape[1] * 2)
    x, wq, scale = _prep(x, packed, scale)
    if _interpreting() and config is None:
        config = dict(_INTERP_CFG, SPLIT=1)
    if config is not None:
        return _launch_pinned(_fwd_kernel, x, wq, scale, global_scale, (M, N), config, "EVEN_K",
                              lambda c: K % c["BLOCK_K"] == 0, "BLOCK_N")
    mb = m_bucket(M)
    grid = lambda a: (triton.cdiv(M, a["BLOCK_M"]) * triton.cdiv(N, a["BLOCK_N"]), a["SPLIT"])  # noqa: E731
    y = x.new_empty(M, N)
    kern = _fwd_small if mb <= 64 else _fwd_large
    kern[grid](x, wq, scale, global_scale, y, M, N, K, x.stride(0), y.stride(0), mb, **_flags(x))
    return y


def nvfp4_matmul_dgrad(dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                       config: dict | None = None) -> torch.Tensor:
    """``dy [M, N] @ Ŵ -> [M, K]`` (the input gradient). ``config`` pins a tile config."""
    M, N = dy.shape
    K = packed.shape[1] * 2
    _check(dy, packed, scale, global_scale, packed.shape[0])
    dy, wq, scale = _prep(dy, packed, scale)
    if _interpreting() and config is None:
        config = dict(_INTERP_CFG, SPLIT=1)
    if config is not None:
        return _launch_pinned(_dgrad_kernel, dy, wq, scale, global_scale, (M, K), config, "EVEN_N",
                              lambda c: N % c["BLOCK_N"] == 0, "BLOCK_K")
    mb = m_bucket(M)
    grid = lambda a: (triton.cdiv(M, a["BLOCK_M"]) * triton.cdiv(K, a["BLOCK_K"]), a["SPLIT"])  # noqa: E731
    if mb <= 64:  # split-N with fp32 atomics: output is tiny, the weight read is what costs
        dx = torch.zeros(M, K, device=dy.device, dtype=torch.float32)
        _dgrad_small[grid](dy, wq, scale, global_scale, dx, M, N, K, dy.stride(0), dx.stride(0), mb, **_flags(dy))
        return dx.to(dy.dtype)
    dx = dy.new_empty(M, K)
    _dgrad_large[grid](dy, wq, scale, global_scale, dx, M, N, K, dy.stride(0), dx.stride(0), mb, **_flags(dy))
    return dx
