"""Gluon NVFP4 kernel for decode-shaped forwards (at most 64 rows): ``y = x @ Ŵᵀ`` straight from the packed weight.

Generation without vLLM (TRL's ``use_vllm=False``, the demo on a GPU, ``model.generate``) runs every decoder Linear
on a handful of rows per step. That matmul is bound by the weight read, so the kernel computes ``yᵀ = Ŵ xᵀ`` with
the weight as the MMA's A operand (a synchronous wgmma on Hopper, mma.sync elsewhere: both take A from registers
with the same per-warp fragment), each lane dequantizing exactly the bytes its A fragment holds. The weight goes
from global memory to the tensor cores through registers only (sm_80+). No host syncs (the global scale is read
through a pointer) and no per-call allocation beyond the output and split-K's fp32 partials, so the kernel is
CUDA-graph safe. Small M splits the reduction over ``SPLIT`` programs that store fp32 partials;
``triton_kernels.sum_splits`` adds them in a fixed order (deterministic).

Every constexpr the kernel takes is a plain int or bool, and the Gluon layouts are built inside the kernel by
:func:`_skinny_layout` (a ``constexpr_function``). That is deliberate: Triton hands the specialization of every
compile to the JIT hooks other libraries install (``knobs.runtime.jit_cache_hook`` / ``jit_post_compile_hook``)
and JSON-serializes it first, whoever the hook belongs to. vLLM's worker installs one after its warm-up
(``vllm/triton_utils/jit_monitor.py``, vLLM 0.24), and a layout object passed as a constexpr made the first
training step after the colocated engine started die with ``TypeError: Object of type BlockedLayout is not JSON
serializable``. ``tests/test_kernel_hooks.py`` checks every kernel's constexprs serialize, and (on a GPU) runs
every dispatch path under such a hook.

Measured (``benchmarks/results/train_matmul-h200.json``, CUDA graphs, L2-cold): a 16-row forward costs
0.81-0.88x BF16 cuBLAS on 5 of 8 Qwen2.5-7B/32B shapes, so ``ops`` picks it there; at 64 rows it loses to
cuBLAS but still beats dequantize + cuBLAS on most shapes. Other row counts, and every input gradient, go through
``triton_kernels.nvfp4_dequantize`` + cuBLAS.

Written against Triton 3.6's Gluon API (``triton.experimental.gluon``); :func:`available` says whether it imports,
and everything else (CPU, the interpreter, other Triton versions) uses dequantize + cuBLAS or the reference.
"""

from __future__ import annotations

import os

import torch

try:  # Gluon is experimental: keep every import failure local to this module
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    _IMPORT_ERROR: Exception | None = None
except Exception as e:  # pragma: no cover - depends on the installed Triton
    _IMPORT_ERROR = e

from ._launch import KernelLauncher
from .triton_kernels import _check, _pair_ptx, sum_splits

__all__ = ["available", "skinny_supported", "nvfp4_matmul_fwd_skinny", "SKINNY_MAX_M"]

#: The most rows the kernel takes (decode batches); larger calls go to dequantize + cuBLAS.
SKINNY_MAX_M = 64


def _skinny_asm(is_bf16: bool) -> str:
    """PTX for the skinny kernel: byte ``c`` (register ``$6`` = ``(c << 12) | ((4 + c) << 4)``) of two words
    (``$4``, ``$5``) scaled by ``$7`` -> four 16-bit values, columns ``2c, 2c+1`` of ``w0`` and of ``w1``: exactly
    the MMA A-fragment entries lane ``c`` of a quad holds. Same exact recipe as ``triton_kernels._dequant_asm``."""
    lines = ["{", ".reg .b32 u, t, m, o, s2, z;", "mov.b32 s2, {$7, $7};", "mov.b32 z, 0x80008000;"]
    for i, reg in enumerate(("$4", "$5")):
        lines += [f"shl.b32 u, {reg}, 4;", *_pair_ptx(reg, "$6", is_bf16), f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, o;"]
    lines.append("}")
    return "\n".join(lines)

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
    @gluon.jit
    def _scale_16bit(s):
        """E4M3 code (int32, 0..255) -> the fp16 bit pattern of ``scale * 2**-8`` (E4M3 subnormals map to fp16
        subnormals), as fp32."""
        bits = ((s & 0x7F) << 7) | ((s & 0x80) << 8)
        return bits.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)


    @gluon.constexpr_function
    def _skinny_layout(which, block_n, warps, g, block_t, wgmma):
        """Layout ``which`` of :func:`_skinny_fwd_kernel`, built at compile time from its integer constexprs:
        0 ``P`` (packed words ``[BLOCK_N, 4, 2 G]``: row, lane in quad, word), 1 ``S`` (scale bytes ``[BLOCK_N, 4,
        G]``), 2/3 the MMA's A/B operands, 4 the accumulator, 5 the activation tile's registers, 6 its shared
        memory. With ``wgmma`` the accumulator is Hopper's (``[16, BLOCK_T, 16]`` instructions, warps stacked along
        the weight rows): its A operand holds each warp's 16 rows exactly like mma.sync's, so the dequantized
        fragments need no data movement either way."""
        rw = block_n // (16 * warps)
        lanes = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]  # lane in quad, then rows 0-7
        warp_bases = [[16 << i, 0, 0] for i in range(warps.bit_length() - 1)]
        rows_hi = [[8, 0, 0]] + [[16 * warps << i, 0, 0] for i in range(rw.bit_length() - 1)]
        if which == 0:
            return gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 1 << i] for i in range((2 * g).bit_length() - 1)] + rows_hi, lane_bases=lanes,
                warp_bases=warp_bases, block_bases=[], shape=[block_n, 4, 2 * g])
        if which == 1:
            return gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 1 << i] for i in range(g.bit_length() - 1)] + rows_hi, lane_bases=lanes,
                warp_bases=warp_bases, block_bases=[], shape=[block_n, 4, g])
        if wgmma:
            acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_t, 16])
        else:
            acc = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
        if which == 2:
            return gl.DotOperandLayout(0, acc, 2)
        if which == 3:
            return gl.DotOperandLayout(1, acc, 2)
        if which == 4:
            return acc
        if which == 5:
            tpr = min(32, 16 * g // 8)  # threads per activation row: 8 values (16 bytes) each
            return gl.BlockedLayout([1, 8], [32 // tpr, tpr], [warps, 1], [1, 0])
        return gl.NVMMASharedLayout.get_default_for([block_t, 16 * g], gl.bfloat16)  # fp16: same 16-bit layout

    _SKINNY_BF16 = gl.constexpr(_skinny_asm(True))
    _SKINNY_F16 = gl.constexpr(_skinny_asm(False))

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
                           BLOCK_T: gl.constexpr, G: gl.constexpr, EVEN: gl.constexpr, WARPS: gl.constexpr,
                           PREFETCH: gl.constexpr, WGMMA: gl.constexpr):
        """``y [M, N] = x @ Ŵᵀ`` for a few rows (M <= BLOCK_T): ``yᵀ = Ŵ @ xᵀ`` with the weight as the MMA's A
        operand, dequantized straight into its A fragments in registers (no shared memory for the weight).

        Lane ``c`` of a quad must hold columns ``2c, 2c+1, 2c+8, 2c+9`` of each 16-group: bytes ``c`` of the group's
        two words. So every lane of a quad loads the same ``2 G`` words of its row (``P_LAYOUT`` over
        ``[BLOCK_N, 4, 2 G]``: row, lane in quad, word; one 128-bit vector per 4 words) and keeps its own byte;
        ``S_LAYOUT`` is the same over ``[BLOCK_N, 4, G]`` (row, lane, group). One step covers ``16 G`` inputs."""
        BK: gl.constexpr = 16 * G
        # layouts are built here from integer constexprs, never passed in: see the module docstring
        P_LAYOUT: gl.constexpr = _skinny_layout(0, BLOCK_N, WARPS, G, BLOCK_T, WGMMA)
        S_LAYOUT: gl.constexpr = _skinny_layout(1, BLOCK_N, WARPS, G, BLOCK_T, WGMMA)
        A_LAYOUT: gl.constexpr = _skinny_layout(2, BLOCK_N, WARPS, G, BLOCK_T, WGMMA)
        B_LAYOUT: gl.constexpr = _skinny_layout(3, BLOCK_N, WARPS, G, BLOCK_T, WGMMA)
        ACC_LAYOUT: gl.constexpr = _skinny_layout(4, BLOCK_N, WARPS, G, BLOCK_T, WGMMA)
        X_LAYOUT: gl.constexpr = _skinny_layout(5, BLOCK_N, WARPS, G, BLOCK_T, WGMMA)
        X_SMEM: gl.constexpr = _skinny_layout(6, BLOCK_N, WARPS, G, BLOCK_T, WGMMA)
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


# ----------------------------------------------------------------------------------------------- host side
if _IMPORT_ERROR is None:
    _skinny_launch = KernelLauncher(_skinny_fwd_kernel)

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


def check_skinny_config(block_n: int, warps: int, g: int, block_t: int, m: int, prefetch: int, wgmma: int,
                        capability: tuple[int, int]) -> None:
    """Raise a ValueError naming what is wrong with a skinny config (before Triton compiles anything)."""
    rw = block_n // (16 * warps) if warps > 0 else 0
    if warps < 1 or warps & (warps - 1) or rw < 1 or rw & (rw - 1) or block_n != 16 * warps * rw:
        raise ValueError(f"skinny NVFP4 kernel: BLOCK_N={block_n} must be 16 * warps * a power of two "
                         f"(warps={warps}, a power of two)")
    if g < 1 or g & (g - 1):
        raise ValueError(f"skinny NVFP4 kernel: G={g} must be a power of two")
    if block_t not in (16, 32, 64) or block_t < m:
        raise ValueError(f"skinny NVFP4 kernel: BLOCK_T={block_t} must be 16, 32 or 64 and at least M={m}")
    if prefetch not in (0, 1):
        raise ValueError(f"skinny NVFP4 kernel: PREFETCH={prefetch} must be 0 or 1 step")
    if wgmma not in (0, 1) or (wgmma and capability[0] != 9):
        raise ValueError(f"skinny NVFP4 kernel: WGMMA={wgmma} must be 0 (mma.sync) or 1 (wgmma, sm_90 only)")
    if wgmma and warps % 4:
        raise ValueError(f"skinny NVFP4 wgmma kernel: warps={warps} must be warp groups of 4")


def skinny_supported(a: torch.Tensor, packed: torch.Tensor) -> bool:
    """The skinny kernel takes ``M <= 64`` bf16/fp16 rows on sm_80+ (mma.sync; wgmma on sm_90)."""
    if not available() or not a.is_cuda or a.dtype not in (torch.bfloat16, torch.float16):
        return False
    if a.shape[0] > SKINNY_MAX_M or packed.data_ptr() % 4:
        return False
    return _capability(a.device) >= (8, 0)


def skinny_constexprs(config: tuple) -> dict:
    """The constexprs a launch with ``config`` (the launcher's cache key) passes: ints and bools only."""
    _, is_bf16, split, block_n, block_t, g, even, warps, prefetch, wgmma = config
    return dict(IS_BF16=is_bf16, SPLIT=split, BLOCK_N=block_n, BLOCK_T=block_t, G=g, EVEN=even, WARPS=warps,
                PREFETCH=prefetch, WGMMA=wgmma)


def nvfp4_matmul_fwd_skinny(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                            global_scale: torch.Tensor, config: tuple | None = None) -> torch.Tensor:
    """``x [M, K] @ Ŵᵀ`` for ``M <= 64`` on sm_80+: weight-read bound, so the weight goes straight from global
    memory into MMA fragments. ``config`` = (BLOCK_N, warps, G[, BLOCK_T[, waves[, prefetch[, wgmma]]]]); BLOCK_T
    (16, 32 or 64) pads the token count for the MMA (0 or absent: the smallest that holds M); the reduction is
    split until about ``waves`` (default 4) programs per SM run; ``prefetch`` (0 or 1) keeps the next step's loads
    in flight; ``wgmma`` (sm_90 only) uses Hopper's MMA instead of mma.sync."""
    M, K = x.shape
    N = packed.shape[0]
    _check(x, packed, scale, global_scale, packed.shape[1] * 2)
    if M > SKINNY_MAX_M:
        raise ValueError(f"skinny NVFP4 kernel takes at most {SKINNY_MAX_M} rows, got {M}")
    block_n, warps, g, *rest = config or _skinny_fwd_default(x.device)
    block_t = rest[0] if rest and rest[0] else max(16, triton.next_power_of_2(M))
    waves = rest[1] if len(rest) > 1 else 4  # programs per SM the K split aims for
    prefetch = rest[2] if len(rest) > 2 else 0
    wgmma = rest[3] if len(rest) > 3 else 0
    check_skinny_config(block_n, warps, g, block_t, M, prefetch, wgmma, _capability(x.device))
    x = x if x.stride(1) == 1 else x.contiguous()
    packed = packed if packed.is_contiguous() else packed.contiguous()
    scale = scale if scale.is_contiguous() else scale.contiguous()
    total = triton.cdiv(K, 16 * g)
    tiles = triton.cdiv(N, block_n)
    split, per = _split(total, tiles, waves, x.device)
    y = x.new_empty((split, M, N) if split > 1 else (M, N), dtype=torch.float32 if split > 1 else x.dtype)
    is_bf16, even = x.dtype == torch.bfloat16, N % block_n == 0 and K % (16 * g) == 0
    key = ("skinny", is_bf16, split, block_n, block_t, g, even, warps, prefetch, wgmma)
    _skinny_launch(
        (tiles, split),
        (x, packed.view(torch.int32), scale.view(torch.uint8), global_scale, y, M, N, K, x.stride(0), y.stride(-2),
         per),
        key, skinny_constexprs(key), dict(num_warps=warps))
    return sum_splits(y, x.dtype) if split > 1 else y


def _skinny_fwd_default(device: torch.device) -> tuple:
    """(BLOCK_N, warps, G, BLOCK_T, waves, prefetch, wgmma): one warp group, 64 weight rows x 128 inputs per step
    (bigger steps keep more bytes in flight than 64), 8 programs per SM; on Hopper a synchronous wgmma with the
    dequantized weight as its register A operand, elsewhere mma.sync.

    Chosen by an H200 config sweep (CUDA graphs over rotated weight copies, 8 Qwen shapes, 16-64 rows; a
    scratch probe): register prefetch of the next step did not help, since it costs programs per SM. The
    committed numbers are ``skinny_graph_ms`` in benchmarks/results/train_matmul-h200.json."""
    return _SKINNY_FWD_HOPPER if _capability(device)[0] == 9 else _SKINNY_FWD_MMA


_SKINNY_FWD_HOPPER = (64, 4, 8, 0, 8, 0, 1)
_SKINNY_FWD_MMA = (64, 4, 8, 0, 8, 0, 0)
