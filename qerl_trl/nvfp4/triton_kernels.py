"""Triton NVFP4 kernels: the one-pass dequantize behind every training matmul, and split-K's fixed-order sum.

Training matmuls have thousands of rows (batch x sequence), where the tensor cores, not the weight read, set the
time. There :func:`nvfp4_dequantize` writes the layer's dense Ŵ once (memory-bound, bit-identical to
``format.dequantize``) and cuBLAS runs the matmul: 1.07-1.16x BF16 at 2048 rows and 1.00-1.15x at 8192 rows on an
H200 (``benchmarks/results/train_matmul-h200.json``). Only one layer's Ŵ exists at a time, and nothing dense is
kept between forward and backward. Fused Triton matmuls that dequantize in registers and warp-specialized Gluon
kernels were measured in that file too (2.5-4.2x and 1.2-1.8x cuBLAS at >= 2048 rows) and removed: they won on
no product path.

The dequantization is exact, with no rounding but the final cast:

* inline PTX (:func:`_dequant_asm`, the Marlin trick) turns two columns per instruction into 16-bit floats:
  keeping a code's sign bit and shifting its three magnitude bits to the exponent/mantissa boundary gives
  ``e2m1 * 2**-126`` as bf16 (or ``e2m1 * 2**-14`` as fp16), 0.5 becoming a subnormal;
* one ``fma`` per pair multiplies by the scale (a unit scale in the dequantize pass, which then applies
  ``scale / global`` in fp32, exactly as the reference does). ``gluon_kernels``' decode kernel reuses the same
  recipe (:func:`_pair_ptx`) with the block scale folded into the ``fma``.

``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors with a portable fp32 dequantization instead of the PTX
(which ``tests/test_triton_kernels.py`` checks separately, with a small PTX interpreter).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._launch import KernelLauncher

__all__ = ["nvfp4_dequantize", "sum_splits", "supported", "m_bucket"]

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def m_bucket(m: int) -> int:
    """Coarse dispatch key for the token count: next power of two in [16, 4096]."""
    b = 16
    while b < m and b < 4096:
        b *= 2
    return b


def _dequant_asm(is_bf16: bool, words: int = 2) -> str:
    """PTX turning ``words`` int32 words (8 E2M1 codes each, column ``c`` in bits ``4c..4c+3`` of word ``c // 8``)
    and a 16-bit scale into ``8 * words`` scaled 16-bit floats, two columns per instruction (the Marlin trick,
    adapted so each output register holds *adjacent* columns and no repacking is needed):

    ``u = q << 4`` puts code ``2b`` in the high nibble of ``u``'s byte ``b``, where ``q``'s byte ``b`` already holds
    code ``2b+1``; ``prmt`` moves those two bytes to bytes 1 and 3, so both codes sit in the top nibble of a
    16-bit half. Keeping the sign bit and shifting the 3 magnitude bits down into the exponent/mantissa boundary
    gives ``e2m1 * 2**-126`` (bf16) or ``e2m1 * 2**-14`` (fp16) exactly (0.5 becomes a subnormal), and one
    ``fma`` per pair applies the scale.
    """
    n_out = 8 * words  # operands: outputs, then the words, then the 16-bit scale
    scale = f"${n_out + words}"
    lines = ["{", ".reg .b32 u, t, m, o, s2, z;", f"mov.b32 s2, {{{scale}, {scale}}};", "mov.b32 z, 0x80008000;"]
    for wi, reg in enumerate(f"${n_out + i}" for i in range(words)):
        lines.append(f"shl.b32 u, {reg}, 4;")
        for b in range(4):
            lines += _pair_ptx(reg, hex((b << 12) | ((4 + b) << 4)), is_bf16)
            lines.append(f"mov.b32 {{${8 * wi + 2 * b}, ${8 * wi + 2 * b + 1}}}, o;")
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


_ASM_F16_WORD = tl.constexpr(_dequant_asm(False, words=1))


@triton.jit
def _scale_f32(s):
    """E4M3 scale bytes -> their value as fp32, exactly, on any GPU (no fp8 cvt): the E4M3 bits placed in an fp16
    give ``scale * 2**-8`` (E4M3 subnormals -> fp16 subnormals)."""
    bits = ((s & 0x7F).to(tl.int16) << 7) | ((s & 0x80).to(tl.int16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _code_value(w, SHIFT: tl.constexpr):
    """E2M1 code at bits ``[SHIFT, SHIFT + 4)`` of int32 words -> its fp32 value (portable path)."""
    c = w >> SHIFT
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


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
    eff = _scale_f32(s) / tl.load(gs_ptr)
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
    # column j = 4*i2 + 2*i1 + i0: tl.join appends the fastest dimension, so the slowest index is joined first;
    # the joins only add register-only dimensions and the reshape merges them (no data moves between threads)
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
def _dequant_stack_kernel(wq_ptr, ws_ptr, gs_ptr, out_ptr, N, K, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                          ROW_STEPS: tl.constexpr, USE_ASM: tl.constexpr):
    """:func:`_dequant_kernel` over a stack of experts ``[E, N, K]``, each under its own global scale (grid axis 2:
    the expert): one launch for a MoE layer's stack, where one a weight took 128 at Qwen3-30B-A3B."""
    e = tl.program_id(2).to(tl.int64)
    wq, ws, out = wq_ptr + e * N * (K // 8), ws_ptr + e * N * (K // 16), out_ptr + e * N * K
    for step in range(ROW_STEPS):
        _dequant_rows(wq, ws, gs_ptr + e, out, N, K, (tl.program_id(0) * ROW_STEPS + step) * BLOCK_R, BLOCK_R,
                      BLOCK_C, USE_ASM)  # fmt: skip


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


#: One fixed config for the dequantize pass. It is memory-bound, and what limits it is bytes in flight per SM:
#: 1024 columns per row (four words, one 16-byte load per thread) and 8 rows per program beat the earlier
#: default 256-column config by 8-13% on six Qwen shapes on an H200 (2.4-3.5 TB/s) and rank first among 8 configs
#: on five of them, within 3% on the sixth (benchmarks/results/launch_overhead-h200.json, part "dequant"). Fixed
#: rather than autotuned so the launch skips the autotuner's per-call Python.
_DEQUANT_CFG = dict(BLOCK_R=8, BLOCK_C=1024, ROW_STEPS=1)
_DEQUANT_WARPS = 4
_dequant_launch = KernelLauncher(_dequant_kernel)
_dequant_stack_launch = KernelLauncher(_dequant_stack_kernel)

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


def nvfp4_dequantize_stack(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense ``[E, N, K]`` of a stack of NVFP4 weights (``packed [E, N, K/2]``, ``scale [E, N, K/16]``, one float32
    global scale an expert ``[E]``) in one kernel, each expert bit-identical to ``format.dequantize``: the grouped
    experts' weights for one grouped GEMM (:mod:`qerl_trl.nvfp4.experts`)."""
    if packed.ndim != 3 or scale.ndim != 3:
        raise ValueError(f"NVFP4 dequantize_stack: packed and scale must be 3-D [experts, N, ...], got "
                         f"{tuple(packed.shape)} and {tuple(scale.shape)}")  # fmt: skip
    E, N, K = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    if K % 16:
        raise ValueError(f"NVFP4 dequantize_stack: in_features {K} is not a multiple of 16")
    if tuple(scale.shape) != (E, N, K // 16):
        raise ValueError(f"NVFP4 dequantize_stack: scale shape {tuple(scale.shape)} does not match packed "
                         f"{tuple(packed.shape)} (expected [experts, N, K/16])")  # fmt: skip
    if global_scale.dtype != torch.float32 or global_scale.numel() != E:
        raise ValueError(f"NVFP4 dequantize_stack: global_scale must be float32 with one value an expert ({E})")
    _, wq, scale = _prep(None, packed, scale)
    gs = global_scale.reshape(E).contiguous()
    out = torch.empty(E, N, K, device=packed.device, dtype=dtype)
    if _interpreting():
        grid = (triton.cdiv(N, 8), triton.cdiv(K, 64), E)
        _dequant_stack_kernel[grid](wq, scale, gs, out, N, K, BLOCK_R=4, BLOCK_C=64, ROW_STEPS=2, USE_ASM=False)
    else:
        use_asm = dtype != torch.float32
        rows = _DEQUANT_CFG["BLOCK_R"] * _DEQUANT_CFG["ROW_STEPS"]
        grid = (triton.cdiv(N, rows), triton.cdiv(K, _DEQUANT_CFG["BLOCK_C"]), E)
        _dequant_stack_launch(grid, (wq, scale, gs, out, N, K), use_asm, dict(_DEQUANT_CFG, USE_ASM=use_asm),
                              dict(num_warps=_DEQUANT_WARPS))
    return out
