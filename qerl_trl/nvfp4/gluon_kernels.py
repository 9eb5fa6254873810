"""Hopper (sm_90) NVFP4 matmuls for the training pass, written in Gluon with warp specialization.

``y = x @ Ŵᵀ`` and ``dx = dy @ Ŵ`` straight from ``weight_packed`` / ``weight_scale`` / ``weight_global_scale``;
Ŵ never reaches global memory. Why Gluon and not plain Triton: Triton 3.6 stages a register-made MMA operand
through shared memory and waits on each wgmma, so dequantization and the tensor cores run one after the other
(``benchmarks/results/fused_structure-h200.json``). Here the two are separate warp groups that run at the same
time, the way CUTLASS's mixed-input GEMMs work:

* a **producer** partition (4 warps) reads packed words and scales from global memory (prefetched two steps
  ahead in registers), dequantizes with the same exact PTX as ``triton_kernels`` (two columns per
  instruction), stores the 16-bit tile into a shared-memory ring in the wgmma layout and issues the TMA load of
  the matching activation tile;
* the **default** partition (4 or 8 warps) only waits on mbarriers and issues asynchronous wgmmas from the ring,
  keeping one in flight, then scales the fp32 accumulator by ``2**7 / global`` (bf16) or ``2**14 / global``
  (fp16) and stores it.

Each weight element is dequantized once per ``BLOCK_M`` rows of activations, so the ALU cost per MMA flop is
fixed while the tensor cores stay busy.

For forwards of at most 64 rows (decode shapes) :func:`nvfp4_matmul_fwd_skinny` swaps the roles instead:
``yᵀ = Ŵ xᵀ`` with the weight as the MMA's A operand (wgmma on Hopper, mma.sync elsewhere: both take A from
registers with the same per-warp fragment), each lane dequantizing exactly the bytes its A fragment holds, so
the weight goes from global memory to the tensor cores through registers only (sm_80+);
:func:`nvfp4_matmul_dgrad_skinny` does the same for ``dxᵀ = Ŵᵀ dyᵀ``, each lane picking one code out of each
word it loads, since a fragment register of ``Ŵᵀ`` pairs two rows of Ŵ. No host syncs (the global scale is read
through a pointer) and no per-call allocation beyond the output (and split-K's fp32 partials), so the kernels are
CUDA-graph safe. Small M splits the reduction over ``SPLIT`` programs: the ``ws`` kernels add fp32 partial sums
atomically; the skinny ones store them and ``triton_kernels.sum_splits`` adds them in a fixed order.

Written against Triton 3.6's Gluon API (``triton.experimental.gluon``); :func:`available` says whether it
imports, and everything else (CPU, the interpreter, other GPUs, other Triton versions) uses
``triton_kernels``.
"""

from __future__ import annotations

import os

import torch

try:  # Gluon is experimental: keep every import failure local to this module
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _IMPORT_ERROR: Exception | None = None
except Exception as e:  # pragma: no cover - depends on the installed Triton
    _IMPORT_ERROR = e

from ._launch import KernelLauncher
from .triton_kernels import _check, _dequant_asm, _pair_ptx, sum_splits

__all__ = ["available", "supported", "skinny_supported", "nvfp4_matmul_fwd_ws", "nvfp4_matmul_dgrad_ws",
           "nvfp4_matmul_fwd_skinny", "nvfp4_matmul_dgrad_skinny"]


def _skinny_asm(is_bf16: bool) -> str:
    """PTX for the skinny kernel: byte ``c`` (register ``$6`` = ``(c << 12) | ((4 + c) << 4)``) of two words
    (``$4``, ``$5``) scaled by ``$7`` -> four 16-bit values, columns ``2c, 2c+1`` of ``w0`` and of ``w1``: exactly
    the MMA A-fragment entries lane ``c`` of a quad holds. Same exact recipe as ``triton_kernels._dequant_asm``."""
    lines = ["{", ".reg .b32 u, t, m, o, s2, z;", "mov.b32 s2, {$7, $7};", "mov.b32 z, 0x80008000;"]
    for i, reg in enumerate(("$4", "$5")):
        lines += [f"shl.b32 u, {reg}, 4;", *_pair_ptx(reg, "$6", is_bf16), f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, o;"]
    lines.append("}")
    return "\n".join(lines)


def _skinny_dgrad_asm(is_bf16: bool) -> str:
    """PTX for the skinny input-gradient kernel: code ``g`` of word ``$2`` (row ``n``) and of word ``$3`` (row
    ``n + 1``), ``$4`` / ``$5`` the rotations that bring it to the top nibble of each half, scaled by ``$6`` /
    ``$7`` -> the two 16-bit values an MMA A fragment of ``Ŵᵀ`` holds in one register (rows ``n, n + 1`` of one
    input column). The codes are put where the Marlin recipe of :func:`~qerl_trl.nvfp4.triton_kernels._pair_ptx`
    expects them (top nibbles of the two halves), then the same exact shift/mask/fma follows, one scale per half."""
    sh, mag = (6, "0x01C001C0") if is_bf16 else (3, "0x0E000E00")
    fma = "fma.rn.bf16x2" if is_bf16 else "fma.rn.f16x2"
    return "\n".join([
        "{", ".reg .b32 a, b, t, m, o, s2, z;", "mov.b32 z, 0x80008000;",
        # rotate code g of row n to bits 12-15 and of row n + 1 to bits 28-31 ($4 = (12 - 4g) & 31, $5 = $4 + 16);
        # the other bits are never read below, so one byte permute merges the two halves
        "shf.l.wrap.b32 a, $2, $2, $4;", "shf.l.wrap.b32 b, $3, $3, $5;", "prmt.b32 t, a, b, 0x7610;",
        "mov.b32 s2, {$6, $7};",
        f"shr.b32 m, t, {sh};", f"and.b32 m, m, {mag};",
        "lop3.b32 t, t, 0x80008000, m, 0xEA;",
        f"{fma} o, t, s2, z;",
        "mov.b32 {$0, $1}, o;", "}"])


#: Gluon's API is experimental and changes between Triton releases; these kernels were written against 3.6.
WRITTEN_FOR_TRITON = "3.6"


def available() -> bool:
    """Gluon imports, the Triton version is the one these kernels were written for (``QERL_NVFP4_GLUON=1``
    tries another one), we are not interpreting, and the user did not turn them off (``QERL_NVFP4_GLUON=0``)."""
    flag = os.environ.get("QERL_NVFP4_GLUON", "auto")
    if _IMPORT_ERROR is not None or flag == "0" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return flag == "1" or triton.__version__.startswith(WRITTEN_FOR_TRITON + ".")


if _IMPORT_ERROR is None:
    _ASM_BF16 = gl.constexpr(_dequant_asm(True, pairs=True))
    _ASM_F16 = gl.constexpr(_dequant_asm(False, pairs=True))

    @gluon.jit
    def _scale_16bit(s):
        """E4M3 code (int32, 0..255) -> the fp16 bit pattern of ``scale * 2**-8`` (E4M3 subnormals map to fp16
        subnormals), as fp32."""
        bits = ((s & 0x7F) << 7) | ((s & 0x80) << 8)
        return bits.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)

    @gluon.jit
    def _join8(o0, o1, o2, o3, o4, o5, o6, o7):
        """8 ``[R, G]`` tensors (column pair j of each 16-group) -> ``[R, 8 G]``. Pair j = 4*i2 + 2*i1 + i0 and
        gl.join appends the fastest dimension, so the slowest index is joined first; the joins only add
        register-only dimensions and the reshape merges them, so no data moves between threads."""
        h = gl.join(gl.join(gl.join(o0, o4), gl.join(o2, o6)), gl.join(gl.join(o1, o5), gl.join(o3, o7)))
        return gl.reshape(h, [o0.shape[0], o0.shape[1] * 8])

    @gluon.jit
    def _dequant_tile(q, s, IS_BF16: gl.constexpr):
        """``q [R, C/8]`` int32 words, ``s [R, C/64]`` int32 or ``[R, C/32]`` int16 scale words (four or two E4M3
        bytes) -> ``[R, C/2]`` int32, each the 16-bit
        pair (columns 2j, 2j+1) of ``e2m1 * scale * 2**-7`` (bf16) or ``* 2**-14`` (fp16), exact, all in
        registers."""
        R: gl.constexpr = q.shape[0]
        G: gl.constexpr = q.shape[1] // 2
        w0, w1 = gl.split(gl.reshape(q, [R, G, 2]))
        if G // s.shape[1] == 4:  # a 32-bit scale word: four groups
            b0 = _scale_16bit(s & 0xFF)
            b1 = _scale_16bit((s >> 8) & 0xFF)
            b2 = _scale_16bit((s >> 16) & 0xFF)
            b3 = _scale_16bit((s >> 24) & 0xFF)
            sf = gl.reshape(gl.join(gl.join(b0, b2), gl.join(b1, b3)), [R, G])
        else:  # a 16-bit scale word: two groups
            s = s.to(gl.int32)
            sf = gl.reshape(gl.join(_scale_16bit(s & 0xFF), _scale_16bit((s >> 8) & 0xFF)), [R, G])
        sf = gl.convert_layout(sf, w0.type.layout)
        if IS_BF16:
            sc = (sf * 2.0**127).to(gl.bfloat16)
            o = gl.inline_asm_elementwise(_ASM_BF16, "=r," * 8 + "r,r,h", [w0, w1, sc],
                                          dtype=(gl.int32,) * 8, is_pure=True, pack=1)
        else:
            sc = (sf * 256.0).to(gl.float16)
            o = gl.inline_asm_elementwise(_ASM_F16, "=r," * 8 + "r,r,h", [w0, w1, sc],
                                          dtype=(gl.int32,) * 8, is_pure=True, pack=1)
        return _join8(o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7])

    @gluon.jit
    def _producer(a_desc, wq_ptr, ws_ptr, a_bufs, w_bufs, ready, empty, off_m, off_out, step0, n_steps,
                  N, K, IS_FWD: gl.constexpr, IS_BF16: gl.constexpr, W_LAYOUT: gl.constexpr,
                  S_LAYOUT: gl.constexpr, W_SMEM32: gl.constexpr, EVEN: gl.constexpr):
        """Dequantize weight tiles into the ring and issue the activation TMA for the same stage."""
        STAGES: gl.constexpr = w_bufs.shape[0]
        WR: gl.constexpr = w_bufs.shape[1]
        WC: gl.constexpr = w_bufs.shape[2]
        BLOCK_RED: gl.constexpr = a_bufs.shape[2]
        r_w = gl.arange(0, WR, layout=gl.SliceLayout(1, W_LAYOUT))
        c_w = gl.arange(0, WC // 8, layout=gl.SliceLayout(0, W_LAYOUT))
        r_s = gl.arange(0, WR, layout=gl.SliceLayout(1, S_LAYOUT))
        SC: gl.constexpr = WC // S_LAYOUT.threads_per_warp[1]  # columns per scale word: 64 (int32) or 32 (int16)
        c_s = gl.arange(0, WC // SC, layout=gl.SliceLayout(0, S_LAYOUT))
        if IS_FWD:  # tile = rows off_out.., columns along the reduction (K)
            q_ptrs = wq_ptr + (off_out + r_w)[:, None] * (K // 8) + (step0 * (WC // 8) + c_w)[None, :]
            s_ptrs = ws_ptr + (off_out + r_s)[:, None] * (K // SC) + (step0 * (WC // SC) + c_s)[None, :]
            q_step = WC // 8
            s_step = WC // SC
        else:  # tile = rows along the reduction (N), columns off_out..
            q_ptrs = wq_ptr + (step0 * WR + r_w)[:, None] * (K // 8) + (off_out // 8 + c_w)[None, :]
            s_ptrs = ws_ptr + (step0 * WR + r_s)[:, None] * (K // SC) + (off_out // SC + c_s)[None, :]
            q_step = WR * (K // 8)
            s_step = WR * (K // SC)

        # two steps of prefetch in registers: global latency is hidden behind two dequantizations
        q0, s0 = _load_masked(q_ptrs, s_ptrs, r_w, c_w, r_s, c_s, off_out, step0, step0 + n_steps, N, K,
                              WR, WC, SC, IS_FWD, EVEN)
        q1, s1 = _load_masked(q_ptrs + q_step, s_ptrs + s_step, r_w, c_w, r_s, c_s, off_out, step0 + 1,
                              step0 + n_steps, N, K, WR, WC, SC, IS_FWD, EVEN)
        for i in range(n_steps):
            q, s = q0, s0
            q0, s0 = q1, s1
            q1, s1 = _load_masked(q_ptrs + (i + 2) * q_step, s_ptrs + (i + 2) * s_step, r_w, c_w, r_s, c_s,
                                  off_out, step0 + i + 2, step0 + n_steps, N, K, WR, WC, SC, IS_FWD, EVEN)
            st = i % STAGES
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
            # the activation load first, so its latency overlaps this step's dequantization
            mbarrier.expect(ready.index(st), a_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, (step0 + i) * BLOCK_RED], ready.index(st),
                                            a_bufs.index(st))
            w = _dequant_tile(q, s, IS_BF16)
            w_bufs.index(st)._reinterpret(gl.int32, [WR, WC // 2], W_SMEM32).store(w)
            fence_async_shared()
            mbarrier.arrive(ready.index(st), count=1)

    @gluon.jit
    def _load_masked(q_ptrs, s_ptrs, r_w, c_w, r_s, c_s, off_out, step, step_end, N, K, WR: gl.constexpr,
                     WC: gl.constexpr, SC: gl.constexpr, IS_FWD: gl.constexpr, EVEN: gl.constexpr):
        """One step's packed and scale words; out-of-range rows/columns and steps past the end read as 0.
        ``EVEN``: the tiles divide the weight, so only the step count needs a (uniform) predicate."""
        live = step < step_end
        if EVEN:
            q = gl.load(q_ptrs, mask=gl.full(q_ptrs.shape, 1, gl.int1, q_ptrs.type.layout) & live, other=0)
            s = gl.load(s_ptrs, mask=gl.full(s_ptrs.shape, 1, gl.int1, s_ptrs.type.layout) & live, other=0)
        else:
            if IS_FWD:
                qm = ((off_out + r_w) < N)[:, None] & ((step * (WC // 8) + c_w) < K // 8)[None, :]
                sm = ((off_out + r_s) < N)[:, None] & ((step * (WC // SC) + c_s) < K // SC)[None, :]
            else:
                qm = ((step * WR + r_w) < N)[:, None] & ((off_out // 8 + c_w) < K // 8)[None, :]
                sm = ((step * WR + r_s) < N)[:, None] & ((off_out // SC + c_s) < K // SC)[None, :]
            q = gl.load(q_ptrs, mask=qm & live, other=0)
            s = gl.load(s_ptrs, mask=sm & live, other=0)
        return q, s

    @gluon.jit
    def _mma(a_bufs, w_bufs, ready, empty, n_steps, IS_FWD: gl.constexpr, ACC_LAYOUT: gl.constexpr):
        """Default partition: asynchronous wgmmas over the ring, one kept in flight; returns the fp32 tile."""
        STAGES: gl.constexpr = w_bufs.shape[0]
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        if IS_FWD:
            BLOCK_OUT: gl.constexpr = w_bufs.shape[1]
        else:
            BLOCK_OUT: gl.constexpr = w_bufs.shape[2]
        acc = gl.zeros([BLOCK_M, BLOCK_OUT], gl.float32, layout=ACC_LAYOUT)
        for i in range(n_steps):
            st = i % STAGES
            mbarrier.wait(ready.index(st), (i // STAGES) & 1)
            if IS_FWD:
                b = w_bufs.index(st).permute((1, 0))
            else:
                b = w_bufs.index(st)
            acc = warpgroup_mma(a_bufs.index(st), b, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # the wgmma of step i-1 has finished: its stage may be refilled
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        return (acc,)  # warp_specialize returns the default partition's results as a tuple

    @gluon.jit
    def _ws_kernel(a_desc, wq_ptr, ws_ptr, gs_ptr, out_ptr, M, N, K, stride_om, steps_per_split,
                   IS_FWD: gl.constexpr, IS_BF16: gl.constexpr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr, WR: gl.constexpr, WC: gl.constexpr,
                   W_LAYOUT: gl.constexpr, S_LAYOUT: gl.constexpr, W_SMEM: gl.constexpr, W_SMEM32: gl.constexpr,
                   ACC_LAYOUT: gl.constexpr, OUT_LAYOUT: gl.constexpr, EVEN: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_RED: gl.constexpr = a_desc.block_type.shape[1]
        if IS_FWD:
            BLOCK_OUT: gl.constexpr = WR
            OUT = N
            RED = K
        else:
            BLOCK_OUT: gl.constexpr = WC
            OUT = K
            RED = N
        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_o = gl.cdiv(OUT, BLOCK_OUT)
        group = GROUP_M * num_pid_o
        first_m = (pid // group) * GROUP_M
        size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + ((pid % group) % size_m)
        pid_o = (pid % group) // size_m
        off_m = pid_m * BLOCK_M
        off_out = pid_o * BLOCK_OUT

        total = gl.cdiv(RED, BLOCK_RED)
        step0 = gl.program_id(1) * steps_per_split
        n_steps = gl.minimum(total - step0, steps_per_split)

        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_RED], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, WR, WC], W_SMEM)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=2)  # the producer's arrive + the TMA's transaction count
            mbarrier.init(empty.index(i), count=1)

        acc, = gl.warp_specialize([
            (_mma, (a_bufs, w_bufs, ready, empty, n_steps, IS_FWD, ACC_LAYOUT)),
            (_producer, (a_desc, wq_ptr, ws_ptr, a_bufs, w_bufs, ready, empty, off_m, off_out, step0, n_steps,
                         N, K, IS_FWD, IS_BF16, W_LAYOUT, S_LAYOUT, W_SMEM32, EVEN)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])

        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))

        if IS_BF16:
            acc = acc * (128.0 / gl.load(gs_ptr))
        else:
            acc = acc * (16384.0 / gl.load(gs_ptr))
        rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, OUT_LAYOUT))
        ro = off_out + gl.arange(0, BLOCK_OUT, layout=gl.SliceLayout(0, OUT_LAYOUT))
        ptrs = out_ptr + rm[:, None] * stride_om + ro[None, :]
        mask = (rm < M)[:, None] & (ro < OUT)[None, :]
        if SPLIT == 1:
            gl.store(ptrs, gl.convert_layout(acc.to(out_ptr.dtype.element_ty), OUT_LAYOUT), mask=mask)
        else:
            gl.atomic_add(ptrs, gl.convert_layout(acc, OUT_LAYOUT), mask=mask, sem="relaxed")


    _SKINNY_BF16 = gl.constexpr(_skinny_asm(True))
    _SKINNY_F16 = gl.constexpr(_skinny_asm(False))
    _SKINNY_DGRAD_BF16 = gl.constexpr(_skinny_dgrad_asm(True))
    _SKINNY_DGRAD_F16 = gl.constexpr(_skinny_dgrad_asm(False))

    @gluon.jit
    def _store_transposed(acc, gs_ptr, out_ptr, off, M, n_cols, stride_om, IS_BF16: gl.constexpr, SPLIT: gl.constexpr,
                          BLOCK: gl.constexpr, BLOCK_T: gl.constexpr, ACC_LAYOUT: gl.constexpr):
        """Epilogue of the skinny kernels: ``acc [BLOCK output columns, BLOCK_T tokens]`` times ``2**7`` (bf16) or
        ``2**14`` (fp16) ``/ global`` into ``out [M, n_cols]``; a split program stores its fp32 partial into slice
        ``program_id(1)`` of ``out [SPLIT, M, n_cols]`` (``triton_kernels.sum_splits`` adds them in order)."""
        if IS_BF16:
            acc = acc * (128.0 / gl.load(gs_ptr))
        else:
            acc = acc * (16384.0 / gl.load(gs_ptr))
        oc = off + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, ACC_LAYOUT))
        om = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, ACC_LAYOUT))
        ptrs = out_ptr + om[None, :] * stride_om + oc[:, None]
        mask = (om < M)[None, :] & (oc < n_cols)[:, None]
        if SPLIT > 1:
            ptrs += gl.program_id(1) * M * stride_om
        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _skinny_fwd_loads(q_ptrs, s_ptrs, x_ptrs, j, k_start, K, q_rmask, s_rmask, xmask, wd, gs, tk,
                          BK: gl.constexpr, EVEN: gl.constexpr):
        """Step ``j`` (of this program's split) of the skinny forward: packed words, scale bytes, activations.
        The pointers are those of step 0; ``EVEN`` tiles need only the token-row mask, so the loads vectorize."""
        if EVEN:
            q = gl.load(q_ptrs + j * (BK // 8))
            sc = gl.load(s_ptrs + j * (BK // 16))
            xv = gl.load(x_ptrs + j * BK, mask=xmask, other=0.0)
        else:
            k0 = k_start + j * BK
            q = gl.load(q_ptrs + j * (BK // 8), mask=q_rmask & ((k0 // 8 + wd) < K // 8)[None, None, :], other=0)
            sc = gl.load(s_ptrs + j * (BK // 16), mask=s_rmask & ((k0 // 16 + gs) < K // 16)[None, None, :],
                         other=0)
            xv = gl.load(x_ptrs + j * BK, mask=xmask & ((k0 + tk) < K)[None, :], other=0.0)
        return q, sc, xv

    @gluon.jit
    def _skinny_fwd_kernel(x_ptr, wq_ptr, ws_ptr, gs_ptr, y_ptr, M, N, K, stride_xm, stride_ym, steps_per_split,
                           IS_BF16: gl.constexpr, SPLIT: gl.constexpr, BLOCK_N: gl.constexpr,
                           BLOCK_T: gl.constexpr, G: gl.constexpr, EVEN: gl.constexpr, P_LAYOUT: gl.constexpr,
                           S_LAYOUT: gl.constexpr, A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr,
                           ACC_LAYOUT: gl.constexpr, X_LAYOUT: gl.constexpr, X_SMEM: gl.constexpr,
                           PREFETCH: gl.constexpr, WGMMA: gl.constexpr):
        """``y [M, N] = x @ Ŵᵀ`` for a few rows (M <= BLOCK_T): ``yᵀ = Ŵ @ xᵀ`` with the weight as the MMA's A
        operand, dequantized straight into its A fragments in registers (no shared memory for the weight).

        Lane ``c`` of a quad must hold columns ``2c, 2c+1, 2c+8, 2c+9`` of each 16-group: bytes ``c`` of the group's
        two words. So every lane of a quad loads the same ``2 G`` words of its row (``P_LAYOUT`` over
        ``[BLOCK_N, 4, 2 G]``: row, lane in quad, word; one 128-bit vector per 4 words) and keeps its own byte;
        ``S_LAYOUT`` is the same over ``[BLOCK_N, 4, G]`` (row, lane, group). One step covers ``16 G`` inputs."""
        BK: gl.constexpr = 16 * G
        pid_n = gl.program_id(0)
        step0 = gl.program_id(1) * steps_per_split
        n_steps = gl.minimum(gl.cdiv(K, BK) - step0, steps_per_split)
        off_n = pid_n * BLOCK_N
        k_start = step0 * BK

        r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, P_LAYOUT)))
        cw = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, P_LAYOUT)))
        wd = gl.arange(0, 2 * G, layout=gl.SliceLayout(0, gl.SliceLayout(1, P_LAYOUT)))
        q_rows = off_n + r
        q_base = q_rows * (K // 8) + k_start // 8
        s_base_r = (off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, S_LAYOUT)))) * (K // 16)
        s_base = s_base_r + k_start // 16
        if EVEN:  # K % (16 G) == 0: every row starts 2 G words / G scale bytes aligned (lets the loads vectorize)
            q_base = gl.multiple_of(q_base, 2 * G)
            s_base = gl.multiple_of(s_base, G)
        q_ptrs = wq_ptr + (q_base[:, None, None] + 0 * cw[None, :, None] + wd[None, None, :])
        q_rmask = (q_rows < N)[:, None, None] & (cw >= 0)[None, :, None]

        rs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, S_LAYOUT)))
        cs = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, S_LAYOUT)))
        gs = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(1, S_LAYOUT)))
        s_rows = off_n + rs
        s_ptrs = ws_ptr + (s_base[:, None, None] + 0 * cs[None, :, None] + gs[None, None, :])
        s_rmask = (s_rows < N)[:, None, None] & (cs >= 0)[None, :, None]
        sel = gl.full([BLOCK_N, 4, G], 0, gl.int32, S_LAYOUT) + ((cs << 12) | ((cs + 4) << 4))[None, :, None]

        # the activation tile goes through shared memory once per program and step (coalesced 16-byte loads),
        # then every warp reads its B fragments with ldmatrix: far fewer load instructions than each warp
        # gathering 32-bit fragments from global memory
        tm = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, X_LAYOUT))
        tk = gl.arange(0, BK, layout=gl.SliceLayout(0, X_LAYOUT))
        x_ptrs = x_ptr + tm[:, None] * stride_xm + k_start + tk[None, :]
        xmask = (tm < M)[:, None] & (tk >= 0)[None, :]
        x_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [BLOCK_T, BK], X_SMEM)

        acc = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=ACC_LAYOUT)
        # PREFETCH: the next step's loads are in flight while a step computes (one program's step is only a few
        # KiB, so without it the loop waits a memory latency per step, but it costs registers: programs per SM)
        if PREFETCH:
            q1, sc1, xv1 = _skinny_fwd_loads(q_ptrs, s_ptrs, x_ptrs, 0, k_start, K, q_rmask, s_rmask, xmask, wd,
                                             gs, tk, BK, EVEN)
        for i in range(n_steps):
            if PREFETCH == 0:
                q, sc, xv = _skinny_fwd_loads(q_ptrs, s_ptrs, x_ptrs, i, k_start, K, q_rmask, s_rmask, xmask, wd,
                                              gs, tk, BK, EVEN)
            else:  # past the last step the same step loads again (an L1 hit, no mask needed)
                q, sc, xv = q1, sc1, xv1
                q1, sc1, xv1 = _skinny_fwd_loads(q_ptrs, s_ptrs, x_ptrs, gl.minimum(i + 1, n_steps - 1), k_start,
                                                 K, q_rmask, s_rmask, xmask, wd, gs, tk, BK, EVEN)
            w0, w1 = gl.split(gl.reshape(q, [BLOCK_N, 4, G, 2]))
            w0 = gl.convert_layout(w0, S_LAYOUT)
            w1 = gl.convert_layout(w1, S_LAYOUT)
            sf = _scale_16bit(sc.to(gl.int32))
            if IS_BF16:
                o = gl.inline_asm_elementwise(_SKINNY_BF16, "=h,=h,=h,=h,r,r,r,h",
                                              [w0, w1, sel, (sf * 2.0**127).to(gl.bfloat16)],
                                              dtype=(gl.bfloat16,) * 4, is_pure=True, pack=1)
            else:
                o = gl.inline_asm_elementwise(_SKINNY_F16, "=h,=h,=h,=h,r,r,r,h",
                                              [w0, w1, sel, (sf * 256.0).to(gl.float16)],
                                              dtype=(gl.float16,) * 4, is_pure=True, pack=1)
            # [N, c, G, b0, h] -> [N, G, h, c, b0]: input column 16 g + 8 h + 2 c + b0
            t = gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3]))
            a = gl.convert_layout(gl.reshape(gl.permute(t, (0, 2, 4, 1, 3)), [BLOCK_N, BK]), A_LAYOUT)
            x_smem.store(xv)
            if WGMMA:
                # synchronous: an asynchronous wgmma reads its register A operand after issue, and the compiler
                # reuses those registers for the next step's dequantization (an H200 probe read NaNs)
                fence_async_shared()
                acc = warpgroup_mma(a, x_smem.permute((1, 0)), acc)
            else:
                acc = mma_v2(a, x_smem.permute((1, 0)).load(B_LAYOUT), acc)

        _store_transposed(acc, gs_ptr, y_ptr, off_n, M, N, stride_ym, IS_BF16, SPLIT, BLOCK_N, BLOCK_T, ACC_LAYOUT)


    @gluon.jit
    def _skinny_dgrad_loads(q_ptrs, s_ptrs, d_ptrs, j, n_start, N, rn, tn, kmask, dmask, K, BR: gl.constexpr,
                            EVEN: gl.constexpr):
        """Step ``j`` of the skinny input gradient: ``BR`` rows of packed words and scales, the matching ``dy``
        columns. The pointers are those of step 0."""
        if EVEN:
            q = gl.load(q_ptrs + j * (BR * (K // 8)))
            sc = gl.load(s_ptrs + j * (BR * (K // 16)))
            dv = gl.load(d_ptrs + j * BR, mask=dmask, other=0.0)
        else:
            n0 = n_start + j * BR
            rmask = ((n0 + rn) < N)[:, None, None] & kmask
            q = gl.load(q_ptrs + j * (BR * (K // 8)), mask=rmask, other=0)
            sc = gl.load(s_ptrs + j * (BR * (K // 16)), mask=rmask, other=0)
            dv = gl.load(d_ptrs + j * BR, mask=dmask & ((n0 + tn) < N)[None, :], other=0.0)
        return q, sc, dv

    @gluon.jit
    def _skinny_dgrad_kernel(dy_ptr, wq_ptr, ws_ptr, gs_ptr, dx_ptr, M, N, K, stride_dm, stride_xm, steps_per_split,
                             IS_BF16: gl.constexpr, SPLIT: gl.constexpr, BLOCK_K: gl.constexpr,
                             BLOCK_T: gl.constexpr, G: gl.constexpr, EVEN: gl.constexpr, Q_LAYOUT: gl.constexpr,
                             A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr, ACC_LAYOUT: gl.constexpr,
                             D_LAYOUT: gl.constexpr, D_SMEM: gl.constexpr, PREFETCH: gl.constexpr,
                             WGMMA: gl.constexpr):
        """``dx [M, K] = dy @ Ŵ`` for a few rows: ``dxᵀ = Ŵᵀ dyᵀ`` with ``Ŵᵀ`` as the MMA's A operand, built in
        registers. An A fragment register holds two *rows* ``n, n + 1`` of Ŵ at one input column, and the codes
        of a row run along the columns, so here every lane of an 8-lane group loads the same two words (16
        columns) of its rows and keeps code ``g`` (its lane / 4) of each: ``Q_LAYOUT`` over ``[BR, 8, BLOCK_K / 8]``
        (reduction row, lane group index, word) gives each lane exactly the words its fragment needs, and the
        dequantized tile is reshaped into the A layout with no data movement. ``BR = 16 G`` rows per step."""
        BR: gl.constexpr = 16 * G
        WK: gl.constexpr = BLOCK_K // 8
        pid_k = gl.program_id(0)
        step0 = gl.program_id(1) * steps_per_split
        n_steps = gl.minimum(gl.cdiv(N, BR) - step0, steps_per_split)
        off_k = pid_k * BLOCK_K
        n_start = step0 * BR

        rn = gl.arange(0, BR, layout=gl.SliceLayout(1, gl.SliceLayout(2, Q_LAYOUT)))
        rg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, Q_LAYOUT)))
        rw = gl.arange(0, WK, layout=gl.SliceLayout(0, gl.SliceLayout(1, Q_LAYOUT)))
        words = off_k // 8 + rw
        q_off = (n_start + rn)[:, None, None] * (K // 8) + 0 * rg[None, :, None] + words[None, None, :]
        s_off = (n_start + rn)[:, None, None] * (K // 16) + 0 * rg[None, :, None] + (words // 2)[None, None, :]
        q_ptrs = wq_ptr + q_off
        s_ptrs = ws_ptr + s_off
        kmask = (rg >= 0)[None, :, None] & (words < K // 8)[None, None, :]
        rot = gl.full([BR, 8, WK], 0, gl.int32, Q_LAYOUT) + ((12 - 4 * rg) & 31)[None, :, None]
        rot_a, _ = gl.split(gl.permute(gl.reshape(rot, [BR // 2, 2, 8, WK]), (0, 2, 3, 1)))
        rot_b = (rot_a + 16) & 31

        tm = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, D_LAYOUT))
        tn = gl.arange(0, BR, layout=gl.SliceLayout(0, D_LAYOUT))
        d_ptrs = dy_ptr + tm[:, None] * stride_dm + n_start + tn[None, :]
        dmask = (tm < M)[:, None] & (tn >= 0)[None, :]
        d_smem = gl.allocate_shared_memory(dy_ptr.dtype.element_ty, [BLOCK_T, BR], D_SMEM)

        acc = gl.zeros([BLOCK_K, BLOCK_T], gl.float32, layout=ACC_LAYOUT)
        if PREFETCH:  # as in the forward: the next step's loads fly while this one computes
            q1, sc1, dv1 = _skinny_dgrad_loads(q_ptrs, s_ptrs, d_ptrs, 0, n_start, N, rn, tn, kmask, dmask, K, BR,
                                               EVEN)
        for i in range(n_steps):
            if PREFETCH == 0:
                q, sc, dv = _skinny_dgrad_loads(q_ptrs, s_ptrs, d_ptrs, i, n_start, N, rn, tn, kmask, dmask, K, BR,
                                                EVEN)
            else:
                q, sc, dv = q1, sc1, dv1
                q1, sc1, dv1 = _skinny_dgrad_loads(q_ptrs, s_ptrs, d_ptrs, gl.minimum(i + 1, n_steps - 1), n_start,
                                                   N, rn, tn, kmask, dmask, K, BR, EVEN)
            wa, wb = gl.split(gl.permute(gl.reshape(q, [BR // 2, 2, 8, WK]), (0, 2, 3, 1)))
            sf = _scale_16bit(sc.to(gl.int32))
            if IS_BF16:
                sv = (sf * 2.0**127).to(gl.bfloat16)
            else:
                sv = (sf * 256.0).to(gl.float16)
            sa, sb = gl.split(gl.permute(gl.reshape(sv, [BR // 2, 2, 8, WK]), (0, 2, 3, 1)))
            if IS_BF16:
                lo, hi = gl.inline_asm_elementwise(_SKINNY_DGRAD_BF16, "=h,=h,r,r,r,r,h,h",
                                                   [wa, wb, rot_a, rot_b, sa, sb],
                                                   dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
            else:
                lo, hi = gl.inline_asm_elementwise(_SKINNY_DGRAD_F16, "=h,=h,r,r,r,r,h,h",
                                                   [wa, wb, rot_a, rot_b, sa, sb],
                                                   dtype=(gl.float16, gl.float16), is_pure=True, pack=1)
            # [n', g, w, p] -> [w, g, n', p] -> A[k = 8 w + g, n = 2 n' + p]
            v = gl.permute(gl.join(lo, hi), (2, 1, 0, 3))
            a = gl.convert_layout(gl.reshape(v, [BLOCK_K, BR]), A_LAYOUT)
            d_smem.store(dv)
            if WGMMA:  # synchronous, as in the forward
                fence_async_shared()
                acc = warpgroup_mma(a, d_smem.permute((1, 0)), acc)
            else:
                acc = mma_v2(a, d_smem.permute((1, 0)).load(B_LAYOUT), acc)

        _store_transposed(acc, gs_ptr, dx_ptr, off_k, M, K, stride_xm, IS_BF16, SPLIT, BLOCK_K, BLOCK_T, ACC_LAYOUT)


# ----------------------------------------------------------------------------------------------- host side
#: (BLOCK_M, BLOCK_OUT, BLOCK_RED, STAGES, default-partition warps, producer warps) by M.
#: Large M: 256-row tiles (two consumer warp groups) halve the dequantization per MMA flop against 128-row
#: tiles, and 8 producer warps (two per scheduler) dequantize faster than 4. H200 probes at 2048/8192 rows
#: (7B shapes): 128-row tiles 2.0-2.4x cuBLAS, 256-row tiles with 4 producer warps 1.3-1.5x, with 8 1.2-1.4x
#: (benchmarks/results/train_matmul-h200.json has the committed numbers).
if _IMPORT_ERROR is None:
    _ws_launch = KernelLauncher(_ws_kernel)
    _skinny_launch = KernelLauncher(_skinny_fwd_kernel)
    _skinny_dgrad_launch = KernelLauncher(_skinny_dgrad_kernel)

_CONFIGS = {
    "small": (64, 128, 64, 4, 4, 4),  # M <= 64: one M tile, the reduction split over SPLIT programs
    "mid": (128, 128, 64, 4, 4, 8),  # M <= 128
    "large": (256, 128, 64, 4, 8, 8),
}
SMALL_M = 64


def supported(a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> bool:
    """sm_90, bf16/fp16 activations, K a multiple of 64 (the scales are read four per 32-bit word), N a multiple
    of 8 (TMA row pitch), 16-byte aligned activation rows; anything else goes to ``triton_kernels``."""
    if not available() or not a.is_cuda or a.dtype not in (torch.bfloat16, torch.float16):
        return False
    n, k = packed.shape[0], packed.shape[1] * 2
    if k % 64 or n % 8 or scale.data_ptr() % 4 or packed.data_ptr() % 4:
        return False
    return _capability(a.device) == (9, 0)


_CAP: dict[int, tuple[int, int]] = {}
_SMS: dict[int, int] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _capability(device: torch.device) -> tuple[int, int]:
    """Compute capability, asked once per device (this runs on every matmul)."""
    idx = _index(device)
    if idx not in _CAP:
        _CAP[idx] = torch.cuda.get_device_capability(idx)
    return _CAP[idx]


def _sm_count(device: torch.device) -> int:
    idx = _index(device)
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _split(total_steps: int, tiles: int, programs_per_sm: int, device: torch.device) -> tuple[int, int]:
    """(SPLIT, steps per split) for a split-K launch: split the reduction until about ``programs_per_sm``
    programs per SM run, keeping at least 4 steps per split; no split ends empty."""
    split = max(1, min(total_steps // 4, triton.cdiv(programs_per_sm * _sm_count(device), tiles)))
    per = triton.cdiv(total_steps, split)
    return triton.cdiv(total_steps, per), per


_LAYOUTS: dict[tuple, tuple] = {}


def _layouts(kind: str, dtype: torch.dtype, bm: int, bo: int, br: int, warps: int, pw: int):
    """Constexpr layouts for one config (built once: Gluon layouts are plain dataclasses)."""
    key = (kind, dtype, bm, bo, br, warps, pw)
    if key not in _LAYOUTS:
        gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
        wr, wc = (bo, br) if kind == "fwd" else (br, bo)
        # each producer thread dequantizes 8 words (64 columns, one int32 scale word) or, when that would leave
        # threads idle, 4 words (32 columns, one int16 scale word)
        wpt = 8 if wr * wc // 8 >= 8 * 32 * pw else 4
        tc = wc // (8 * wpt)  # threads per row
        if tc < 1 or 32 % tc:
            raise ValueError(f"NVFP4 Gluon kernel: weight tile {wr}x{wc} does not fit {pw} producer warps")
        w_layout = gl.BlockedLayout([1, wpt], [32 // tc, tc], [pw, 1], [1, 0])
        s_layout = gl.BlockedLayout([1, 1], [32 // tc, tc], [pw, 1], [1, 0])
        acc_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                               instr_shape=[16, min(bo, 256), 16])
        to = min(32, bo // 8)
        out_layout = gl.BlockedLayout([1, 8], [32 // to, to], [warps, 1], [1, 0])
        w_smem = gl.NVMMASharedLayout.get_default_for([wr, wc], gdt)
        # the producer stores 32-bit pairs into the same bytes: same swizzle, 32-bit elements
        w_smem32 = gl.NVMMASharedLayout(swizzle_byte_width=w_smem.swizzle_byte_width, element_bitwidth=32, rank=2)
        _LAYOUTS[key] = (
            gl.NVMMASharedLayout.get_default_for([bm, br], gdt),
            w_smem, w_smem32, w_layout, s_layout, acc_layout, out_layout, wr, wc, wpt,
        )
    return _LAYOUTS[key]


def _run(kind: str, a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
         config: tuple | None = None) -> torch.Tensor:
    M = a.shape[0]
    N, K = packed.shape[0], packed.shape[1] * 2
    out_cols, red = (N, K) if kind == "fwd" else (K, N)
    _check(a, packed, scale, global_scale, red)
    if a.stride(1) != 1 or (a.stride(0) * a.element_size()) % 16 or a.data_ptr() % 16:
        a = a.contiguous()  # TMA wants 16-byte aligned rows
    packed = packed if packed.is_contiguous() else packed.contiguous()
    scale = scale if scale.is_contiguous() else scale.contiguous()
    regime = "small" if M <= SMALL_M else "mid" if M <= 128 else "large"
    bm, bo, br, stages, warps, pw = _full(config or _CONFIGS[regime])
    a_smem, w_smem, w_smem32, w_layout, s_layout, acc_layout, out_layout, wr, wc, wpt = _layouts(
        kind, a.dtype, bm, bo, br, warps, pw)
    a_desc = TensorDescriptor.from_tensor(a, [bm, br], a_smem)
    total = triton.cdiv(red, br)
    tiles = triton.cdiv(M, bm) * triton.cdiv(out_cols, bo)
    # small M: one M tile, so split the reduction to fill the SMs
    split, per = _split(total, tiles, 2, a.device) if M <= SMALL_M else (1, total)
    if split > 1:
        out = torch.zeros(M, out_cols, device=a.device, dtype=torch.float32)
    else:
        out = a.new_empty(M, out_cols)
    is_fwd, is_bf16, even = kind == "fwd", a.dtype == torch.bfloat16, N % wr == 0 and K % wc == 0
    _ws_launch(
        (tiles, split),
        (a_desc, packed.view(torch.int32), scale.view(torch.uint8).view(torch.int32 if wpt == 8 else torch.int16),
         global_scale, out, M, N, K, out.stride(0), per),
        ("ws", is_fwd, is_bf16, split, bm, bo, br, stages, warps, pw, even),
        dict(IS_FWD=is_fwd, IS_BF16=is_bf16, SPLIT=split, GROUP_M=8, STAGES=stages, WR=wr, WC=wc, W_LAYOUT=w_layout,
             S_LAYOUT=s_layout, W_SMEM=w_smem, W_SMEM32=w_smem32, ACC_LAYOUT=acc_layout, OUT_LAYOUT=out_layout,
             EVEN=even, PRODUCER_WARPS=pw, PRODUCER_REGS=_PRODUCER_REGS[pw]),
        dict(num_warps=warps, maxnreg=_maxnreg(warps + pw)))
    return out.to(a.dtype) if split > 1 else out


#: Registers: the producer holds two prefetched steps plus one tile being dequantized; the default partition
#: (whatever the kernel-wide ``maxnreg`` leaves) holds the fp32 accumulator (BLOCK_M * BLOCK_OUT / threads).
_PRODUCER_REGS = {4: 128, 8: 88}


def _maxnreg(total_warps: int) -> int:
    """Registers per thread such that every warp (rounded up to warp groups) fits the 64K register file."""
    groups = -(-total_warps // 4)
    return min(256, 65536 // (groups * 128)) // 8 * 8


def _full(config: tuple) -> tuple:
    """Configs may leave out the producer warps (4)."""
    return tuple(config) if len(config) == 6 else (*config, 4)


def nvfp4_matmul_fwd_ws(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                        config: tuple | None = None) -> torch.Tensor:
    """``x [M, K] @ Ŵᵀ -> [M, N]`` on Hopper. ``config`` = (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, warps[,
    producer warps])."""
    return _run("fwd", x, packed, scale, global_scale, config)


def nvfp4_matmul_dgrad_ws(dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                          global_scale: torch.Tensor, config: tuple | None = None) -> torch.Tensor:
    """``dy [M, N] @ Ŵ -> [M, K]`` on Hopper. ``config`` = (BLOCK_M, BLOCK_K, BLOCK_N, STAGES, warps[,
    producer warps])."""
    return _run("dgrad", dy, packed, scale, global_scale, config)


# ------------------------------------------------------------------------------------- skinny forward (M small)
SKINNY_MAX_M = 64
_SKINNY_LAYOUTS: dict[tuple, tuple] = {}


def _skinny_layouts(block_n: int, warps: int, g: int, block_t: int, wgmma: int = 0):
    """Layouts for :func:`_skinny_fwd_kernel`. With ``wgmma`` the accumulator is Hopper's (``[16, BLOCK_T, 16]``
    instructions, warps stacked along the weight rows): its A operand holds each warp's 16 rows exactly like
    mma.sync's, so the dequantized fragments need no data movement either way."""
    key = (block_n, warps, g, block_t, wgmma)
    if key not in _SKINNY_LAYOUTS:
        rw = block_n // (16 * warps)
        if rw < 1 or rw & (rw - 1) or g & (g - 1):
            raise ValueError(f"skinny NVFP4 kernel: BLOCK_N={block_n} must be 16 * warps * a power of two")
        log2 = lambda v: v.bit_length() - 1  # noqa: E731
        lanes = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]  # lane in quad, then rows 0-7
        warp_bases = [[16 << i, 0, 0] for i in range(log2(warps))]
        rows_hi = [[8, 0, 0]] + [[16 * warps << i, 0, 0] for i in range(log2(rw))]
        p_layout = gl.DistributedLinearLayout(  # [BLOCK_N, 4, 2 G] words
            reg_bases=[[0, 0, 1 << i] for i in range(log2(2 * g))] + rows_hi, lane_bases=lanes,
            warp_bases=warp_bases, block_bases=[], shape=[block_n, 4, 2 * g])
        s_layout = gl.DistributedLinearLayout(  # [BLOCK_N, 4, G] groups
            reg_bases=[[0, 0, 1 << i] for i in range(log2(g))] + rows_hi, lane_bases=lanes,
            warp_bases=warp_bases, block_bases=[], shape=[block_n, 4, g])
        if wgmma:
            if warps % 4 or block_n % (16 * warps):
                raise ValueError(f"skinny NVFP4 wgmma kernel: warps={warps} must be warp groups of 4")
            acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_t, 16])
        else:
            acc = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
        tpr = min(32, 16 * g // 8)  # threads per activation row: 8 values (16 bytes) each
        x_layout = gl.BlockedLayout([1, 8], [32 // tpr, tpr], [warps, 1], [1, 0])
        x_smem = gl.NVMMASharedLayout.get_default_for([block_t, 16 * g], gl.bfloat16)  # fp16: same 16-bit layout
        _SKINNY_LAYOUTS[key] = (p_layout, s_layout, gl.DotOperandLayout(0, acc, 2), gl.DotOperandLayout(1, acc, 2),
                                acc, x_layout, x_smem)
    return _SKINNY_LAYOUTS[key]


def skinny_supported(a: torch.Tensor, packed: torch.Tensor) -> bool:
    """The skinny kernels take ``M <= 64`` bf16/fp16 rows on sm_80+ (mma.sync; wgmma on sm_90)."""
    if not available() or not a.is_cuda or a.dtype not in (torch.bfloat16, torch.float16):
        return False
    if a.shape[0] > SKINNY_MAX_M or packed.data_ptr() % 4:
        return False
    return _capability(a.device) >= (8, 0)


def nvfp4_matmul_fwd_skinny(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                            global_scale: torch.Tensor, config: tuple | None = None) -> torch.Tensor:
    """``x [M, K] @ Ŵᵀ`` for ``M <= 64`` on sm_80+: weight-read bound, so the weight goes straight from global
    memory into MMA fragments. ``config`` = (BLOCK_N, warps, G[, BLOCK_T[, waves[, prefetch]]]); BLOCK_T (16, 32
    or 64) pads the token count for the MMA (0 or absent: the smallest that holds M); the reduction is split until
    about ``waves`` (default 4) programs per SM run; ``prefetch`` (0 or 1) keeps the next step's loads in flight."""
    M, K = x.shape
    N = packed.shape[0]
    _check(x, packed, scale, global_scale, packed.shape[1] * 2)
    if M > SKINNY_MAX_M:
        raise ValueError(f"skinny NVFP4 kernel takes at most {SKINNY_MAX_M} rows, got {M}")
    block_n, warps, g, *rest = config or _skinny_fwd_default(M, x.device)
    block_t = rest[0] if rest and rest[0] else max(16, triton.next_power_of_2(M))
    waves = rest[1] if len(rest) > 1 else 4  # programs per SM the K split aims for
    prefetch = rest[2] if len(rest) > 2 else 0
    wgmma = rest[3] if len(rest) > 3 else 0
    if block_t < M:
        raise ValueError(f"skinny NVFP4 kernel: BLOCK_T={block_t} is smaller than M={M}")
    if prefetch not in (0, 1):
        raise ValueError(f"skinny NVFP4 kernel: PREFETCH={prefetch} must be 0 or 1 step")
    if wgmma not in (0, 1) or (wgmma and _capability(x.device)[0] != 9):
        raise ValueError(f"skinny NVFP4 kernel: WGMMA={wgmma} must be 0 (mma.sync) or 1 (wgmma, sm_90 only)")
    p_layout, s_layout, a_layout, b_layout, acc_layout, x_layout, x_smem = _skinny_layouts(block_n, warps, g,
                                                                                           block_t, wgmma)
    x = x if x.stride(1) == 1 else x.contiguous()
    packed = packed if packed.is_contiguous() else packed.contiguous()
    scale = scale if scale.is_contiguous() else scale.contiguous()
    total = triton.cdiv(K, 16 * g)
    tiles = triton.cdiv(N, block_n)
    split, per = _split(total, tiles, waves, x.device)
    y = x.new_empty((split, M, N) if split > 1 else (M, N), dtype=torch.float32 if split > 1 else x.dtype)
    is_bf16, even = x.dtype == torch.bfloat16, N % block_n == 0 and K % (16 * g) == 0
    _skinny_launch(
        (tiles, split),
        (x, packed.view(torch.int32), scale.view(torch.uint8), global_scale, y, M, N, K, x.stride(0), y.stride(-2),
         per),
        ("skinny", is_bf16, split, block_n, block_t, g, even, warps, prefetch, wgmma),
        dict(IS_BF16=is_bf16, SPLIT=split, BLOCK_N=block_n, BLOCK_T=block_t, G=g, EVEN=even,
             P_LAYOUT=p_layout, S_LAYOUT=s_layout, A_LAYOUT=a_layout, B_LAYOUT=b_layout, ACC_LAYOUT=acc_layout,
             X_LAYOUT=x_layout, X_SMEM=x_smem, PREFETCH=prefetch, WGMMA=wgmma),
        dict(num_warps=warps))
    return sum_splits(y, x.dtype) if split > 1 else y


# ----------------------------------------------------------------------------- skinny input gradient (M small)
_SKINNY_DGRAD_LAYOUTS: dict[tuple, tuple] = {}


def _skinny_dgrad_layouts(warps: int, g: int, rk: int, block_t: int, wgmma: int = 0):
    """Layouts for :func:`_skinny_dgrad_kernel`: ``BLOCK_K = 16 * warps * rk`` input columns per program (one
    16-row MMA block per warp, ``rk`` repeats), ``16 g`` reduction rows per step."""
    key = (warps, g, rk, block_t, wgmma)
    if key not in _SKINNY_DGRAD_LAYOUTS:
        if any(v < 1 or v & (v - 1) for v in (warps, g, rk)):
            raise ValueError(f"skinny NVFP4 dgrad kernel: warps={warps}, G={g}, RK={rk} must be powers of two")
        log2 = lambda v: v.bit_length() - 1  # noqa: E731
        block_k, br = 16 * warps * rk, 16 * g
        q_layout = gl.DistributedLinearLayout(  # [BR rows, 8 lane groups, BLOCK_K / 8 words]
            reg_bases=[[0, 0, 1], [1, 0, 0], [8, 0, 0]] + [[16 << i, 0, 0] for i in range(log2(g))]
            + [[0, 0, (2 * warps) << i] for i in range(log2(rk))],
            lane_bases=[[2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
            warp_bases=[[0, 0, 2 << i] for i in range(log2(warps))], block_bases=[], shape=[br, 8, block_k // 8])
        if wgmma:  # same per-warp A fragments, warps stacked along the input columns (see _skinny_layouts)
            if warps % 4:
                raise ValueError(f"skinny NVFP4 dgrad wgmma kernel: warps={warps} must be warp groups of 4")
            acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_t, 16])
        else:
            acc = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
        tpr = min(32, br // 8)
        d_layout = gl.BlockedLayout([1, 8], [32 // tpr, tpr], [warps, 1], [1, 0])
        d_smem = gl.NVMMASharedLayout.get_default_for([block_t, br], gl.bfloat16)
        _SKINNY_DGRAD_LAYOUTS[key] = (q_layout, gl.DotOperandLayout(0, acc, 2), gl.DotOperandLayout(1, acc, 2), acc,
                                      d_layout, d_smem)
    return _SKINNY_DGRAD_LAYOUTS[key]


def nvfp4_matmul_dgrad_skinny(dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                              global_scale: torch.Tensor, config: tuple | None = None) -> torch.Tensor:
    """``dy [M, N] @ Ŵ -> [M, K]`` for ``M <= 64`` on sm_80+, the weight going from global memory into MMA
    fragments through registers only. ``config`` = (warps, G, RK[, BLOCK_T[, waves[, prefetch]]]): ``16 * warps *
    RK`` input columns per program, ``16 G`` reduction rows per step, the reduction split until about ``waves``
    programs per SM run, ``prefetch`` (0 or 1) keeps the next step's loads in flight."""
    M, N = dy.shape
    K = packed.shape[1] * 2
    _check(dy, packed, scale, global_scale, packed.shape[0])
    if M > SKINNY_MAX_M:
        raise ValueError(f"skinny NVFP4 kernel takes at most {SKINNY_MAX_M} rows, got {M}")
    warps, g, rk, *rest = config or _skinny_dgrad_default(dy.device)
    block_t = rest[0] if rest and rest[0] else max(16, triton.next_power_of_2(M))
    waves = rest[1] if len(rest) > 1 else 4
    prefetch = rest[2] if len(rest) > 2 else 0
    wgmma = rest[3] if len(rest) > 3 else 0
    if block_t < M:
        raise ValueError(f"skinny NVFP4 kernel: BLOCK_T={block_t} is smaller than M={M}")
    if prefetch not in (0, 1):
        raise ValueError(f"skinny NVFP4 kernel: PREFETCH={prefetch} must be 0 or 1 step")
    if wgmma not in (0, 1) or (wgmma and _capability(dy.device)[0] != 9):
        raise ValueError(f"skinny NVFP4 kernel: WGMMA={wgmma} must be 0 (mma.sync) or 1 (wgmma, sm_90 only)")
    q_layout, a_layout, b_layout, acc_layout, d_layout, d_smem = _skinny_dgrad_layouts(warps, g, rk, block_t, wgmma)
    dy = dy if dy.stride(1) == 1 else dy.contiguous()
    packed = packed if packed.is_contiguous() else packed.contiguous()
    scale = scale if scale.is_contiguous() else scale.contiguous()
    block_k = 16 * warps * rk
    total = triton.cdiv(N, 16 * g)
    tiles = triton.cdiv(K, block_k)
    split, per = _split(total, tiles, waves, dy.device)
    dx = dy.new_empty((split, M, K) if split > 1 else (M, K), dtype=torch.float32 if split > 1 else dy.dtype)
    is_bf16, even = dy.dtype == torch.bfloat16, N % (16 * g) == 0 and K % block_k == 0
    _skinny_dgrad_launch(
        (tiles, split),
        (dy, packed.view(torch.int32), scale.view(torch.uint8), global_scale, dx, M, N, K, dy.stride(0),
         dx.stride(-2), per),
        ("skinny_dgrad", is_bf16, split, block_k, block_t, g, even, warps, rk, prefetch, wgmma),
        dict(IS_BF16=is_bf16, SPLIT=split, BLOCK_K=block_k, BLOCK_T=block_t, G=g, EVEN=even, Q_LAYOUT=q_layout,
             A_LAYOUT=a_layout, B_LAYOUT=b_layout, ACC_LAYOUT=acc_layout, D_LAYOUT=d_layout, D_SMEM=d_smem,
             PREFETCH=prefetch, WGMMA=wgmma),
        dict(num_warps=warps))
    return sum_splits(dx, dy.dtype) if split > 1 else dx


def _skinny_fwd_default(M: int, device: torch.device) -> tuple:
    """(BLOCK_N, warps, G, BLOCK_T, waves, prefetch, wgmma) for the skinny forward: one warp group, 64 weight
    rows x 128 inputs per step (bigger steps keep more bytes in flight than 64), 8 programs per SM; on Hopper a
    synchronous wgmma with the dequantized weight as its register A operand, elsewhere mma.sync.

    Chosen by an H200 config sweep (CUDA graphs over rotated weight copies, 8 Qwen shapes, 16-64 rows; a
    scratch probe): register prefetch of the next step did not help, since it costs programs per SM. The
    committed numbers are ``skinny_graph_ms`` in benchmarks/results/train_matmul-h200.json."""
    return _SKINNY_FWD_HOPPER if _capability(device)[0] == 9 else _SKINNY_FWD_MMA


def _skinny_dgrad_default(device: torch.device) -> tuple:
    """(warps, G, RK, BLOCK_T, waves, prefetch, wgmma) for the skinny input gradient: 32 reduction rows x 64
    input columns per step, the next step's loads in flight (the transposed fragments need many small loads),
    8 programs per SM; wgmma on Hopper (same sweep). Reading Ŵ down its columns costs: the transposed fragment
    needs ~10 instructions per weight, the forward's about half."""
    return _SKINNY_DGRAD_HOPPER if _capability(device)[0] == 9 else _SKINNY_DGRAD_MMA


_SKINNY_FWD_HOPPER = (64, 4, 8, 0, 8, 0, 1)
_SKINNY_FWD_MMA = (64, 4, 8, 0, 8, 0, 0)
_SKINNY_DGRAD_HOPPER = (4, 2, 1, 0, 8, 1, 1)
_SKINNY_DGRAD_MMA = (4, 2, 1, 0, 8, 1, 0)
