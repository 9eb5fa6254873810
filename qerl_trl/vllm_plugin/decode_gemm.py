"""``y = x · dequant(W)ᵀ + (x · Aᵀ) · Bᵀ`` on the NVFP4A16 layout in one GEMM launch, for 1-256 rows (no vLLM imports).

Why: an RL rollout decodes a few to a few hundred sequences, so every linear sees 1-256 rows, and its time is the
read of the FP4 weight. vLLM serves NVFP4A16 on Hopper with Marlin, an Ampere design, and our LoRA then took two more
launches per linear (``lora_kernels``). Here the weight tile is the MMA's 64-row operand and the few tokens its narrow
one ("swap A and B": ``yᵀ = Ŵ · xᵀ``): each program streams ``BN`` weight rows, dequantizes them in registers
(``triton_kernels``' PTX recipe, the block scale folded into the pair ``fma``), multiplies them with all its tokens
at once (wgmma on Hopper: ``HGMMA`` in the SASS), and no dense weight is ever written.

* **Loads.** The shipped kernel (:func:`_decode_gemm_tma_kernel`) has the copy engine bring in the weight words,
  scale bytes and activations through host tensor descriptors, 3 steps deep (Triton's software pipeline): on the
  H100 that halved the time of plain loads (:func:`_decode_gemm_kernel`, kept for layers whose rows the copy engine
  cannot address, ``k % 256 != 0``).
* **Split-K without a second launch.** Few output tiles (o, down, qkv) split the reduction over ``SPLITS`` programs
  that store fp32 partials. The last of a tile's programs to finish (a per-tile semaphore, which it resets to zero)
  sums them in split order and runs the epilogue: deterministic, no atomics on data, no memset, no host sync.
* **The LoRA expand is the epilogue.** The finished shrink ``t = x Aᵀ`` ``[M, S·r]`` (one small launch per layer:
  ``lora_kernels``' serial shrink, rounded to the activation dtype as the plain formulation does) is multiplied by
  the tile's rows of ``B``, reading only the diagonal block of the packed sub-module (``S`` slots: q/k/v, gate/up)
  that each output row belongs to, and added before the one rounding to the activation dtype.
* **Exactness.** The dequantized weight is ``e2m1 · scale`` exactly (1 + 3 mantissa bits fit a 16-bit float); the
  global scale multiplies the fp32 accumulator. So the GEMM is exact up to fp32 accumulation, a little closer to the
  true product than the reference's ``round(e2m1 · scale / global)``.

**Status (measured, not yet on a product path).** On the H100 (``benchmarks/results/decode_linear-h100.json``, at
df7e5b9) a Qwen2.5 decoder layer's four linears take 0.68-0.84x Marlin's speed at 1-16 rows without a LoRA (7B:
107-111 µs against 85-90 µs; 34-44% of HBM against Marlin's 44-59%), and 0.77-0.86x Marlin plus the two-launch LoRA
pair with it; 0.92-1.05x that pair at 64-128 rows. Nsight Compute on the 7B gate/up at 16 rows (ab98afc): DRAM at
47% of peak, issue slots 62% busy, 5 programs (20 warps) per SM, limited by registers and shared memory; about 6.5
instructions per weight (issue rate over weights read). The engine therefore keeps Marlin (``single_lora``); this kernel is the measured base for
the next attempt.

CUDA-graph capturable (fixed launch shapes per row count, state in per-layer buffers that end as they began), every
constexpr a plain int or bool (vLLM's JIT hook JSON-serializes them), and :func:`nvfp4_lora_linear` is a
``torch.library`` op with a fake implementation (vLLM torch.compiles the model). ``TRITON_INTERPRET=1`` runs the same
kernel on CPU with a portable dequantization (no PTX).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qerl_trl.nvfp4._launch import KernelLauncher
from qerl_trl.nvfp4.triton_kernels import _code_value, _dequant_asm, _interpreting, _pair_ptx

from .lora_kernels import lora_shrink

__all__ = ["MAX_ROWS", "DecodeConfig", "decode_config", "nvfp4_lora_linear", "nvfp4_lora_linear_reference",
           "decode_workspace"]

#: Rows (tokens) the kernel takes; more rows are a prefill, which the caller sends elsewhere.
MAX_ROWS = 256
_ASM_BF16 = tl.constexpr(_dequant_asm(True, words=1))
_ASM_F16 = tl.constexpr(_dequant_asm(False, words=1))


def _byte_asm(is_bf16: bool) -> str:
    """PTX: byte ``c`` of word ``$2`` (selector ``$3`` = ``(c << 12) | ((4 + c) << 4)``) times the 16-bit scale
    ``$4`` -> its two columns ``2c``, ``2c + 1`` as 16-bit floats (``$0``, ``$1``): the share of a word that lane ``c``
    of a quad holds in an MMA operand fragment (the recipe of ``triton_kernels._dequant_asm``)."""
    lines = ["{", ".reg .b32 u, t, m, o, s2, z;", "mov.b32 s2, {$4, $4};", "mov.b32 z, 0x80008000;",
             "shl.b32 u, $2, 4;", *_pair_ptx("$2", "$3", is_bf16), "mov.b32 {$0, $1}, o;", "}"]
    return "\n".join(lines)


_BYTE_BF16 = tl.constexpr(_byte_asm(True))
_BYTE_F16 = tl.constexpr(_byte_asm(False))


@dataclass(frozen=True)
class DecodeConfig:
    """One launch shape: ``bn`` weight rows x ``bt`` tokens per program, ``bk`` inputs per step, ``splits`` of K."""

    bn: int
    bk: int
    bt: int
    splits: int
    warps: int
    stages: int
    tma: bool = True
    quad: bool = False  # lane c of a quad dequantizes byte c of each word (the MMA operand layout)


@triton.jit
def _dequant_tile(q, sc, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr):
    """Packed words ``q`` [BN, BK/8] (int32, 8 codes each) and their scale bytes ``sc`` (E4M3, one per word) ->
    ``e2m1 · scale · 2^E`` [BN, BK] in the MMA dtype, exactly (``E``: -7 bf16, -14 fp16, 0 fp32; MODE 0/1/2).

    MODE 0/1: the PTX recipe with the scale in the ``fma`` (two columns per instruction); 2: the portable fp32 path of
    the interpreter."""
    bits = ((sc & 0x7F).to(tl.int16) << 7) | ((sc & 0x80).to(tl.int16) << 8)
    sf = bits.to(tl.float16, bitcast=True).to(tl.float32)  # scale * 2^-8, exact (E4M3 subnormals too)
    if MODE == 0:
        o = tl.inline_asm_elementwise(_ASM_BF16, "=h," * 8 + "r,h", [q, (sf * 2.0**127).to(tl.bfloat16)],
                                      dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        c0, c1, c2, c3, c4, c5, c6, c7 = o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]
    elif MODE == 1:
        o = tl.inline_asm_elementwise(_ASM_F16, "=h," * 8 + "r,h", [q, (sf * 256.0).to(tl.float16)],
                                      dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        c0, c1, c2, c3, c4, c5, c6, c7 = o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]
    else:
        s = sf * 256.0
        c0, c1 = _code_value(q, 0) * s, _code_value(q, 4) * s
        c2, c3 = _code_value(q, 8) * s, _code_value(q, 12) * s
        c4, c5 = _code_value(q, 16) * s, _code_value(q, 20) * s
        c6, c7 = _code_value(q, 24) * s, _code_value(q, 28) * s
    # column 8w + j of the tile is c_j of word w (same register-only joins as triton_kernels._dequant_rows)
    return tl.reshape(tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7))),
                      (BN, BK))


@triton.jit
def _scale_16bit(sg, MODE: tl.constexpr):
    """E4M3 scale bytes -> the 16-bit scale the PTX ``fma`` takes (``scale · 2^119`` as bf16, ``scale`` as fp16), or
    the scale as fp32 (MODE 2), exactly: the E4M3 bits placed in an fp16 are ``scale · 2^-8``."""
    bits = ((sg & 0x7F).to(tl.int16) << 7) | ((sg & 0x80).to(tl.int16) << 8)
    sf = bits.to(tl.float16, bitcast=True).to(tl.float32)
    if MODE == 0:
        out = (sf * 2.0**127).to(tl.bfloat16)
    elif MODE == 1:
        out = (sf * 256.0).to(tl.float16)
    else:
        out = sf * 256.0
    return out  # one return: Triton 3.6 types every return of a function alike, constexpr branches or not


@triton.jit
def _dequant_tile_quad(q, sg, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr):
    """:func:`_dequant_tile` shaped for the MMA's operand layout: every word is broadcast to the 4 lanes of a quad and
    lane ``c`` dequantizes only byte ``c`` (columns ``8w + 2c``, ``8w + 2c + 1``), which is what that lane holds in an
    A fragment: Triton then loads the words from shared memory straight in the operand layout, and no exchange
    between threads is left. ``sg``: the scale bytes, one per 16 columns (converted once, then one per word)."""
    W: tl.constexpr = BK // 8
    q4 = tl.broadcast_to(q[:, :, None], (BN, W, 4))
    c = tl.arange(0, 4)[None, None, :]
    s16 = _scale_16bit(sg, MODE)
    s4 = tl.broadcast_to(tl.reshape(tl.join(s16, s16), (BN, W))[:, :, None], (BN, W, 4))  # word 2g+j: scale g
    if MODE == 2:
        byte = (q4 >> (c * 8)) & 0xFF
        lo, hi = _code_value(byte, 0) * s4, _code_value(byte, 4) * s4
    else:
        sel = tl.broadcast_to((c << 12) | ((c + 4) << 4), (BN, W, 4))
        if MODE == 0:
            lo, hi = tl.inline_asm_elementwise(_BYTE_BF16, "=h,=h,r,r,h", [q4, sel, s4], dtype=(tl.bfloat16,) * 2,
                                               is_pure=True, pack=1)
        else:
            lo, hi = tl.inline_asm_elementwise(_BYTE_F16, "=h,=h,r,r,h", [q4, sel, s4], dtype=(tl.float16,) * 2,
                                               is_pure=True, pack=1)
    return tl.reshape(tl.join(lo, hi), (BN, BK))  # [BN, W, 4, 2] -> column 8w + 2c + b


@triton.jit
def _mma(acc, w, xv, UPCAST: tl.constexpr):
    """``acc + w · xvᵀ`` (``w`` [BN, BK] weights, ``xv`` [BT, BK] tokens). The interpreter's 16-bit ``tl.dot`` is wrong
    (Triton 3.6-3.9): fp32 there."""
    if UPCAST:
        acc += tl.dot(w.to(tl.float32), tl.trans(xv.to(tl.float32)), input_precision="ieee")
    else:
        acc = tl.dot(w, tl.trans(xv), acc)
    return acc


@triton.jit
def _step_loads(q_ptrs, s_ptrs, x_ptrs, i, step0, K, nmask, tmask, wd, kk, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """Step ``i`` of a program's K range: packed words [BN, BK/8], their scale bytes, the activations [BT, BK]. The
    pointers are step 0's; ``EVEN_K`` tiles need only the row masks, so the loads vectorize."""
    if EVEN_K:
        q = tl.load(q_ptrs + i * (BK // 8), mask=nmask[:, None], other=0)
        sc = tl.load(s_ptrs + i * (BK // 16), mask=nmask[:, None], other=0)
        xv = tl.load(x_ptrs + i * BK, mask=tmask[:, None], other=0.0)
    else:
        k0 = (step0 + i) * BK
        kmask = ((k0 // 8 + wd) < K // 8)[None, :]
        q = tl.load(q_ptrs + i * (BK // 8), mask=nmask[:, None] & kmask, other=0)
        sc = tl.load(s_ptrs + i * (BK // 16), mask=nmask[:, None] & kmask, other=0)
        xv = tl.load(x_ptrs + i * BK, mask=tmask[:, None] & ((k0 + kk) < K)[None, :], other=0.0)
    return q, sc, xv


@triton.jit
def _decode_gemm_kernel(x_ptr, wq_ptr, ws_ptr, gs_ptr, t_ptr, b_ptr, bounds_ptr, sem_ptr, p_ptr, y_ptr,
                        M, N, K, stride_xm, stride_ym, stride_bn, R, steps_per_split, SPLITS,
                        BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, SPLIT_K: tl.constexpr,
                        MODE: tl.constexpr, EVEN_K: tl.constexpr, HAS_LORA: tl.constexpr, S: tl.constexpr,
                        RANK: tl.constexpr, RP: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """One (weight-row tile, K split, token block) of ``yᵀ = Ŵ xᵀ (+ B tᵀ)``; see the module docstring."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_t = tl.program_id(2)
    W: tl.constexpr = BK // 8
    rn = pid_n * BN + tl.arange(0, BN)
    rt = pid_t * BT + tl.arange(0, BT)
    nmask = rn < N
    tmask = rt < M
    step0 = pid_k * steps_per_split
    n_steps = tl.minimum(tl.cdiv(K, BK) - step0, steps_per_split)
    wd = tl.arange(0, W)
    kk = tl.arange(0, BK)
    q_ptrs = wq_ptr + rn[:, None] * (K // 8) + step0 * W + wd[None, :]
    s_ptrs = ws_ptr + rn[:, None] * (K // 16) + step0 * (BK // 16) + (wd // 2)[None, :]
    x_ptrs = x_ptr + rt[:, None] * stride_xm + step0 * BK + kk[None, :]
    acc = tl.zeros((BN, BT), dtype=tl.float32)
    for i in range(n_steps):
        q, sc, xv = _step_loads(q_ptrs, s_ptrs, x_ptrs, i, step0, K, nmask, tmask, wd, kk, BK, EVEN_K)
        acc = _mma(acc, _dequant_tile(q, sc, BN, BK, MODE), xv, UPCAST)
    _finish(acc, gs_ptr, t_ptr, b_ptr, bounds_ptr, sem_ptr, p_ptr, y_ptr, M, N, stride_ym, stride_bn, R, SPLITS,
            BN, BT, SPLIT_K, MODE, HAS_LORA, S, RANK, RP, UPCAST)


@triton.jit
def _decode_gemm_tma_kernel(x_desc, q_desc, s_desc, gs_ptr, t_ptr, b_ptr, bounds_ptr, sem_ptr, p_ptr, y_ptr,
                            M, N, K, stride_ym, stride_bn, R, steps_per_split, SPLITS,
                            BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, SPLIT_K: tl.constexpr,
                            MODE: tl.constexpr, HAS_LORA: tl.constexpr, S: tl.constexpr, RANK: tl.constexpr,
                            RP: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr, QUAD: tl.constexpr):  # fmt: skip
    """:func:`_decode_gemm_kernel` with the weight words, scale bytes and activations brought in by the copy engine
    (TMA: host tensor descriptors), ``STAGES`` steps in flight per program without registers; the descriptors
    zero-fill past the tensors' ends, so no masks."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_t = tl.program_id(2)
    step0 = pid_k * steps_per_split
    n_steps = tl.minimum(tl.cdiv(K, BK) - step0, steps_per_split)
    acc = tl.zeros((BN, BT), dtype=tl.float32)
    for i in tl.range(0, n_steps, num_stages=STAGES):
        step = step0 + i
        q = q_desc.load([pid_n * BN, step * (BK // 8)])
        sg = s_desc.load([pid_n * BN, step * (BK // 16)])
        xv = x_desc.load([pid_t * BT, step * BK])
        if QUAD:
            w = _dequant_tile_quad(q, sg, BN, BK, MODE)
        else:
            w = _dequant_tile(q, tl.reshape(tl.join(sg, sg), (BN, BK // 8)), BN, BK, MODE)  # word 2g+j: scale g
        acc = _mma(acc, w, xv, UPCAST)
    _finish(acc, gs_ptr, t_ptr, b_ptr, bounds_ptr, sem_ptr, p_ptr, y_ptr, M, N, stride_ym, stride_bn, R, SPLITS,
            BN, BT, SPLIT_K, MODE, HAS_LORA, S, RANK, RP, UPCAST)


@triton.jit
def _finish(acc, gs_ptr, t_ptr, b_ptr, bounds_ptr, sem_ptr, p_ptr, y_ptr, M, N, stride_ym, stride_bn, R, SPLITS,
            BN: tl.constexpr, BT: tl.constexpr, SPLIT_K: tl.constexpr, MODE: tl.constexpr, HAS_LORA: tl.constexpr,
            S: tl.constexpr, RANK: tl.constexpr, RP: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """After the K loop: the global scale, split-K's reduction by the tile's last program, the epilogue."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_t = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rt = pid_t * BT + tl.arange(0, BT)
    # the accumulator holds sum(e2m1 * scale * x) * 2^E: undo 2^E and divide by the global scale
    if MODE == 0:
        acc = acc * (128.0 / tl.load(gs_ptr))
    elif MODE == 1:
        acc = acc * (16384.0 / tl.load(gs_ptr))
    else:
        acc = acc / tl.load(gs_ptr)
    omask = (rn < N)[:, None] & (rt < M)[None, :]
    if SPLIT_K:
        # store this split's partial [SPLITS, M, N]; the last program of the tile sums them in split order
        tl.store(p_ptr + (pid_k * M + rt[None, :]) * N + rn[:, None], acc, mask=omask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        sem = sem_ptr + pid_t * tl.num_programs(0) + pid_n
        done = tl.atomic_add(sem, 1, sem="acq_rel")
        if done == SPLITS - 1:
            acc = tl.zeros((BN, BT), dtype=tl.float32)
            for s in range(SPLITS):
                acc += tl.load(p_ptr + (s * M + rt[None, :]) * N + rn[:, None], mask=omask, other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(sem, 0)
            _epilogue(acc, t_ptr, b_ptr, bounds_ptr, y_ptr, rn, rt, M, omask, pid_n, stride_ym, stride_bn, R, BN,
                      HAS_LORA, S, RANK, RP, UPCAST)
    else:
        _epilogue(acc, t_ptr, b_ptr, bounds_ptr, y_ptr, rn, rt, M, omask, pid_n, stride_ym, stride_bn, R, BN,
                  HAS_LORA, S, RANK, RP, UPCAST)


@triton.jit
def _epilogue(acc, t_ptr, b_ptr, bounds_ptr, y_ptr, rn, rt, M, omask, pid_n, stride_ym, stride_bn, R,
              BN: tl.constexpr, HAS_LORA: tl.constexpr, S: tl.constexpr, RANK: tl.constexpr, RP: tl.constexpr,
              UPCAST: tl.constexpr):  # fmt: skip
    """``y = acc (+ B_j t_jᵀ on the rows of each slot j)``, rounded once to ``y``'s dtype and stored transposed."""
    if HAS_LORA:
        rj = tl.arange(0, RP)
        n_lo = pid_n * BN
        for j in tl.static_range(S):
            lo = tl.load(bounds_ptr + j)
            hi = tl.load(bounds_ptr + j + 1)
            if (lo < n_lo + BN) & (hi > n_lo):
                in_slot = (rn >= lo) & (rn < hi)
                b = tl.load(b_ptr + rn[:, None] * stride_bn + j * RANK + rj[None, :],
                            mask=in_slot[:, None] & (rj < RANK)[None, :], other=0.0)  # [BN, RP]
                t = tl.load(t_ptr + rt[None, :] * R + j * RANK + rj[:, None],
                            mask=(rt < M)[None, :] & (rj < RANK)[:, None], other=0.0)  # [RP, BT]
                if UPCAST:
                    acc += tl.dot(b.to(tl.float32), t.to(tl.float32), input_precision="ieee")
                else:
                    acc = tl.dot(b, t, acc)
    if UPCAST and y_ptr.dtype.element_ty == tl.bfloat16:  # round to nearest even by hand: the interpreter truncates
        bits = acc.to(tl.int32, bitcast=True)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rt[None, :] * stride_ym + rn[:, None], out, mask=omask)


_gemm_launch = KernelLauncher(_decode_gemm_kernel)
_gemm_tma_launch = KernelLauncher(_decode_gemm_tma_kernel)


def tma_ok(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, cfg: DecodeConfig) -> bool:
    """Whether the copy engine can bring in these tiles: 16-byte aligned bases and row strides (``k`` a multiple of
    256 for the scale bytes' rows) and boxes of at least 16 bytes and at most 256 elements a side."""
    k = x2.shape[1]
    aligned = all(t.data_ptr() % 16 == 0 for t in (x2, packed, scale)) and (x2.stride(0) * x2.element_size()) % 16 == 0
    return aligned and k % 256 == 0 and cfg.bk == 256 and cfg.bt <= 256 and cfg.bn <= 256
_SMS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any fixed figure (an H100's)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


#: Programs per SM the K split aims for at decode sizes (weight-read bound: bytes in flight per SM), and the most
#: tokens per program. From the H100 sweeps (``decode_linear_sweep-h100.json``, 1b81e68, and
#: ``decode_linear_quad-h100.json``, a082897): at 16 tokens, 4 waves and 3 TMA stages of the plain dequantization
#: were best or within 3% on every Qwen2.5-7B linear; from 32 tokens, 2 stages of the quad dequantization (7B
#: gate/up at 64 rows: 69 µs against 102 µs); 256 tokens per program spilled the accumulator (1.26 ms on gate/up
#: against 0.42 ms as four blocks of 64)
WAVES = 4
BT_MAX = 64


def decode_config(m: int, n: int, k: int, device: torch.device, bn: int = 64, bk: int = 256, waves: int = WAVES,
                  warps: int = 4, stages: int = 0, bt_max: int = BT_MAX, tma: int = 1, quad: int = -1) -> DecodeConfig:
    """The launch shape for ``m`` tokens through an ``[n, k]`` weight: ``bn`` weight rows x up to ``bt_max`` tokens
    (a power of two from 16) per program; split K until about ``waves`` programs per SM run, at least 4 steps each.
    ``stages`` TMA steps in flight and ``quad`` dequantization (0 / -1: as measured best, see :data:`WAVES`)."""
    bt = min(bt_max, max(16, triton.next_power_of_2(m)))
    stages = stages or (3 if bt <= 16 else 2)
    quad = bt > 16 if quad < 0 else bool(quad)
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bt)
    steps = triton.cdiv(k, bk)
    splits = max(1, min(steps // 4, triton.cdiv(waves * _sm_count(device), tiles)))
    per = triton.cdiv(steps, splits)
    return DecodeConfig(bn, bk, bt, triton.cdiv(steps, per), warps, stages, bool(tma), quad)


def decode_workspace(n: int, device: torch.device | str | None = None, bn_min: int = 16) -> torch.Tensor:
    """Zeroed int32 semaphores for one layer of ``n`` output rows: one per weight-row tile (at the smallest tile,
    ``bn_min`` rows) and token block (up to 16 blocks: 4096 rows of 256), left at zero by every launch."""
    return torch.zeros(triton.cdiv(n, bn_min) * 16, dtype=torch.int32, device=device)


def nvfp4_lora_linear_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                                a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
    """The plain formulation, for tests: dequantize (fp32), two more GEMMs for the LoRA, the shrink rounded to the
    activation dtype."""
    from qerl_trl.nvfp4.format import dequantize

    w = dequantize(packed, scale.view(torch.float8_e4m3fn), global_scale, torch.float32)
    y = x.float() @ w.t()
    if a is not None:
        y = y + (x @ a.t()).float() @ b.float().t()
    return y.to(x.dtype)


def _launch(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
            a: torch.Tensor | None, b: torch.Tensor | None, bounds: torch.Tensor | None, rank: int,
            sems: torch.Tensor, cfg: DecodeConfig | None = None) -> torch.Tensor:
    m, k = x2.shape
    n = packed.shape[0]
    cfg = cfg or decode_config(m, n, k, x2.device)
    if k % 16 or cfg.bk % 16 or cfg.bn % 16 or cfg.bt < 16:
        raise ValueError(f"NVFP4 decode GEMM: in_features {k} and the config {cfg} need multiples of 16")
    interp = _interpreting()
    mode = 2 if interp else (0 if x2.dtype == torch.bfloat16 else 1)
    has_lora = a is not None
    if has_lora:
        t = lora_shrink(x2, a, bounds[a.shape[0] // rank + 1:])  # the layer's bounds buffer carries its semaphores
        r_total, slots = a.shape[0], a.shape[0] // rank
        rp = max(16, triton.next_power_of_2(rank))
        b_stride = b.stride(0)
    else:
        t = b = bounds = x2  # unread
        r_total, slots, rp, b_stride = 0, 1, 16, 0
    y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    steps = triton.cdiv(k, cfg.bk)
    per = triton.cdiv(steps, cfg.splits)
    splits = triton.cdiv(steps, per)
    tiles, t_blocks = triton.cdiv(n, cfg.bn), triton.cdiv(m, cfg.bt)
    if splits > 1 and sems.numel() < tiles * t_blocks:
        raise ValueError(f"NVFP4 decode GEMM: {tiles * t_blocks} semaphores needed, the workspace has {sems.numel()}")
    p = torch.empty((splits, m, n), device=x2.device, dtype=torch.float32) if splits > 1 else y
    if cfg.tma and tma_ok(x2, packed, scale, cfg):
        from triton.tools.tensor_descriptor import TensorDescriptor

        key = (mode, cfg.bn, cfg.bk, cfg.bt, splits > 1, has_lora, slots, rank, rp, cfg.warps, cfg.stages, cfg.quad)
        _gemm_tma_launch(
            (tiles, splits, t_blocks),
            (TensorDescriptor.from_tensor(x2, [cfg.bt, cfg.bk]),
             TensorDescriptor.from_tensor(packed.view(torch.int32), [cfg.bn, cfg.bk // 8]),
             TensorDescriptor.from_tensor(scale.view(torch.uint8), [cfg.bn, cfg.bk // 16]), global_scale, t, b,
             bounds, sems, p, y, m, n, k, y.stride(0), b_stride, r_total, per, splits),
            key,
            dict(BN=cfg.bn, BK=cfg.bk, BT=cfg.bt, SPLIT_K=splits > 1, MODE=mode, HAS_LORA=has_lora, S=slots,
                 RANK=rank, RP=rp, UPCAST=interp, STAGES=cfg.stages, QUAD=cfg.quad),
            dict(num_warps=cfg.warps))
        return y
    even = k % cfg.bk == 0
    key = (mode, cfg.bn, cfg.bk, cfg.bt, splits > 1, even, has_lora, slots, rank, rp, interp, cfg.warps, cfg.stages)
    _gemm_launch(
        (tiles, splits, t_blocks),
        (x2, packed.view(torch.int32), scale.view(torch.uint8), global_scale, t, b, bounds, sems, p, y, m, n, k,
         x2.stride(0), y.stride(0), b_stride, r_total, per, splits),
        key,
        dict(BN=cfg.bn, BK=cfg.bk, BT=cfg.bt, SPLIT_K=splits > 1, MODE=mode, EVEN_K=even, HAS_LORA=has_lora, S=slots,
             RANK=rank, RP=rp, UPCAST=interp),
        dict(num_warps=cfg.warps, num_stages=1))  # deeper software pipelines ran out of shared memory on the H100
    return y


@torch.library.custom_op("qerl_trl::nvfp4_lora_linear", mutates_args=())
def nvfp4_lora_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                      a: torch.Tensor | None, b: torch.Tensor | None, bounds: torch.Tensor | None, rank: int,
                      sems: torch.Tensor) -> torch.Tensor:
    """``x · dequant(W)ᵀ (+ (x Aᵀ) Bᵀ)`` for up to :data:`MAX_ROWS` tokens of an NVFP4A16 layer (a new tensor).

    ``packed`` uint8 ``[N, K/2]``, ``scale`` E4M3 (or its bytes) ``[N, K/16]``, ``global_scale`` fp32 ``[1]``
    (compressed-tensors' ``weight_packed`` / ``weight_scale`` / ``weight_global_scale``). LoRA (or ``None``):
    ``a`` ``[S·rank, K]``, ``b`` ``[N, S·rank]`` with the scaling folded in (only its diagonal blocks are read),
    ``bounds`` from :func:`~qerl_trl.vllm_plugin.lora_kernels.lora_slot_bounds`. ``sems``:
    :func:`decode_workspace` of this layer."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if not 0 < x2.shape[0] <= MAX_ROWS:
        raise ValueError(f"nvfp4_lora_linear takes 1 to {MAX_ROWS} rows, got {x2.shape[0]}")
    if packed.shape[1] * 2 != k or packed.dtype != torch.uint8:
        raise ValueError(f"nvfp4_lora_linear: weight_packed {tuple(packed.shape)} {packed.dtype} does not match "
                         f"{k} input columns (uint8 [out, in/2] expected)")
    if a is not None and (b is None or bounds is None or a.stride(-1) != 1 or b.stride(-1) != 1):
        raise ValueError("nvfp4_lora_linear: a LoRA needs row-major A and B and the layer's slot bounds")
    y = _launch(x2, packed, scale, global_scale, a, b, bounds, rank, sems)
    return y.view(*x.shape[:-1], packed.shape[0])


@nvfp4_lora_linear.register_fake
def _(x, packed, scale, global_scale, a, b, bounds, rank, sems):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))
