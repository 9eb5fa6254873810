"""The single-LoRA delta ``y + (x A^T) B^T`` in two Triton launches for decode-sized inputs (no vLLM imports).

Why: an RL rollout decodes a few to a few dozen sequences, so each LoRA'd linear sees 1-64 rows. There the plain
formulation's shrink output is only ``rows x S*r`` (at most 96 columns at r=32), one or two output tiles that
cuBLAS runs on a handful of SMs, and its expand reads a block-diagonal ``B`` whose off-diagonal zeros are S times
the bytes it needs. On the H100 the two GEMMs took 9.5-13 µs per linear in a CUDA graph, and the LoRA cost 45% of
NVFP4 decode at batch 1 (``benchmarks/results/rollout-h100.json``).

Here the shrink splits K over many programs and writes fp32 partial sums (``[splits, rows, S*r]``), and the expand
reads only the diagonal block of ``B`` that its output rows belong to and adds the product to ``y``. Two pairs,
picked by the layer's output width:

* **split** (qkv, o, down): each expand program sums its slot's partials itself. No atomics, no memset.
* **serial** (gate/up, at least :data:`SERIAL_MIN_COLS` columns): there the expand has 600-900 programs, and
  re-summing the partials in each cost more than the rest of the delta. Instead, the last shrink program of each
  block sums them once, in split order, behind a semaphore it resets to zero. The semaphores sit at the tail of the
  layer's bounds buffer, one buffer per layer.

Both pairs are the same two kernels, the serial one selected by a ``SERIAL`` constexpr. Both round the shrink to
the activation dtype, as the plain path's bf16 GEMM does. Both are deterministic, need no host sync, and have fixed
launch shapes per row count (CUDA-graph safe). On the H100 (``lora_delta-h100.json``,
L2-cold, in CUDA graphs, one run at 5005a69) a Qwen2.5-7B decode step's LoRA deltas take 0.92 / 1.04 ms at 1 / 16
rows. cuBLAS takes 1.36 / 1.33 ms there, and the split pair alone 0.99 / 1.25 ms. The floor is the two launches
per linear (6-11 µs together), not the bytes. One fused launch that recomputes its slot's shrink in every program
was measured too: it was 2-6x slower, because of each program's serial K loop.

:func:`lora_delta_add` is a ``torch.library`` custom op, opaque to torch.compile (vLLM compiles the model), and
falls back to the two GEMMs above :data:`KERNEL_MAX_ROWS` rows, where cuBLAS is as fast or faster. It leaves every
input as it found it: the semaphores go back to zero. One layer's op never runs concurrently with itself: vLLM runs
the model on one stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl_trl.nvfp4._launch import KernelLauncher
from qerl_trl.nvfp4.triton_kernels import _interpreting

__all__ = ["KERNEL_MAX_ROWS", "lora_delta_add", "lora_delta_add_reference", "lora_slot_bounds"]

#: Rows (tokens) up to which the Triton pairs run; above it the two cuBLAS GEMMs. From
#: ``benchmarks/results/lora_delta-h100.json`` (Qwen2.5 7B and 32B layers, r=32, L2-cold): at 32 rows every kernel
#: variant lost to cuBLAS on qkv, o and down (7B: 14.4 / 12.6 / 16.3 µs against 12.0 / 11.0 / 12.5).
KERNEL_MAX_ROWS = 16
_BK = 128  # shrink: K per inner step
_BR = 32  # shrink: LoRA rows (of S*r) per program
_BN = 64  # expand: output columns per program
#: Semaphores at the tail of each layer's bounds buffer (the serial shrink needs one per row block x LoRA-row block)
SEMAPHORES = 64
#: Output columns from which the serial pair beats the split pair. Qwen2.5 7B-32B gate/up has 37888-55296 columns:
#: 9.8-10.9 µs against 12.6-18.1 µs at 1-16 rows. qkv, o and down have 3584-7168 columns, where the split pair is
#: 1.4-2.2 µs faster (``lora_delta-h100.json``).
SERIAL_MIN_COLS = 16384


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, p_ptr, s_ptr, sem_ptr, M, K, R, stride_xm, stride_am, SPLITS,
                        K_CHUNK: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, SC: tl.constexpr,
                        PREC: tl.constexpr, UPCAST: tl.constexpr, SERIAL: tl.constexpr):  # fmt: skip
    """Partial ``x[:, chunk] @ A[:, chunk]^T`` of one K chunk, one block of rows and one block of LoRA rows, stored
    in ``p``. ``SERIAL``: the last program of each (row, LoRA-row) block to finish (a semaphore) also sums the
    block's partials in split order into ``s``, rounded to ``s``'s dtype, and resets the semaphore to zero."""
    pid_k = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rr = pid_r * BR + tl.arange(0, BR)
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    for k0 in range(0, K_CHUNK, BK):
        rk = pid_k * K_CHUNK + k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        a = tl.load(a_ptr + rr[None, :] * stride_am + rk[:, None], mask=(rr[None, :] < R) & (rk[:, None] < K), other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=PREC)
    omask = (rm[:, None] < M) & (rr[None, :] < R)
    tl.store(p_ptr + (pid_k * M + rm[:, None]) * R + rr[None, :], acc, mask=omask)
    if SERIAL:
        sem = sem_ptr + pid_m * tl.num_programs(1) + pid_r
        done = tl.atomic_add(sem, 1, sem="acq_rel")
        if done == SPLITS - 1:
            rs = tl.arange(0, SC)
            tot = tl.zeros((BM, BR), dtype=tl.float32)
            for s0 in range(0, SPLITS, SC):
                sp = s0 + rs
                offs = (sp[:, None, None] * M + rm[None, :, None]) * R + rr[None, None, :]
                mask = (sp[:, None, None] < SPLITS) & omask[None, :, :]
                tot += tl.sum(tl.load(p_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg"), axis=0)
            tl.store(s_ptr + rm[:, None] * R + rr[None, :], tot.to(s_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(sem, 0)


@triton.jit
def _lora_expand_kernel(p_ptr, s_ptr, b_ptr, y_ptr, out_ptr, bounds_ptr, M, N, R, SPLITS, stride_bn, stride_ym,
                        stride_om, S: tl.constexpr, RANK: tl.constexpr, RP: tl.constexpr, SC: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                        SERIAL: tl.constexpr):  # fmt: skip
    """``out = y + s_j @ B_j^T`` on one block of output columns, ``j`` the slot (packed sub-module) of each column:
    columns ``bounds[j] <= n < bounds[j+1]`` use LoRA rows ``j*RANK ..`` of the shrink and of ``B``. The shrink is
    the finished ``s`` ``[M, R]`` (``SERIAL``) or the sum of the partials ``p``, rounded to the activation dtype."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rj = tl.arange(0, RP)
    n_lo = pid_n * BN
    ymask = (rm[:, None] < M) & (rn[None, :] < N)
    y = tl.load(y_ptr + rm[:, None] * stride_ym + rn[None, :], mask=ymask, other=0.0)  # the base GEMM's, done
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for j in tl.static_range(S):
        lo = tl.load(bounds_ptr + j)
        hi = tl.load(bounds_ptr + j + 1)
        if (lo < n_lo + BN) & (hi > n_lo):
            in_slot = (rn >= lo) & (rn < hi)
            b = tl.load(b_ptr + rn[None, :] * stride_bn + j * RANK + rj[:, None],
                        mask=in_slot[None, :] & (rj[:, None] < RANK), other=0.0)  # fmt: skip
            smask = (rm[:, None] < M) & (rj[None, :] < RANK)
            if SERIAL:
                s = tl.load(s_ptr + rm[:, None] * R + j * RANK + rj[None, :], mask=smask, other=0.0)
            else:
                rs = tl.arange(0, SC)
                tot = tl.zeros((BM, RP), dtype=tl.float32)
                for s0 in range(0, SPLITS, SC):
                    sp = s0 + rs
                    offs = (sp[:, None, None] * M + rm[None, :, None]) * R + j * RANK + rj[None, None, :]
                    tot += tl.sum(tl.load(p_ptr + offs, mask=(sp[:, None, None] < SPLITS) & smask[None, :, :],
                                          other=0.0), axis=0)  # fmt: skip
                s = tot.to(b.dtype)  # the activation dtype, as the plain path's shrink output
            if UPCAST:
                s = s.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(s, b, input_precision=PREC)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], (y.to(tl.float32) + acc).to(y.dtype), mask=ymask)


_shrink_launch = KernelLauncher(_lora_shrink_kernel)
_expand_launch = KernelLauncher(_lora_expand_kernel)


def lora_slot_bounds(slot_starts: list[int], out_rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``int32 [S+1+SEMAPHORES]``: where each packed sub-module's output rows start in the layer's local output, the
    end, then :data:`SEMAPHORES` zeros: the serial shrink's per-block semaphores, which it leaves at zero. One such
    buffer per layer, so no two layers share a semaphore."""
    bounds = [int(s) for s in slot_starts] + [int(out_rows)]
    if bounds != sorted(bounds) or bounds[0] != 0:
        raise ValueError(f"LoRA slot starts must rise from 0 to the output size, got {bounds}.")
    return torch.tensor(bounds + [0] * SEMAPHORES, dtype=torch.int32, device=device)


def lora_delta_add_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The plain formulation: ``y + (x A^T) B^T`` with the block-diagonal ``B``, two GEMMs."""
    shrunk = torch.matmul(x, a.t())
    return torch.addmm(y.reshape(-1, y.shape[-1]), shrunk.reshape(-1, shrunk.shape[-1]), b.t()).view(y.shape)


def _use_kernel(x: torch.Tensor, rows: int) -> bool:
    return 0 < rows <= KERNEL_MAX_ROWS and (x.is_cuda or _interpreting())


def _shrink(x2: torch.Tensor, a: torch.Tensor, semaphores: torch.Tensor, bk: int, serial: bool, rp: int = 16
            ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """One shrink launch: ``(partials [splits, m, R] fp32, shrunk, splits, partials per sum step)``; ``shrunk`` is
    the finished ``x A^T`` ``[m, R]`` in ``x``'s dtype when ``serial`` (else the partials, which the split expand
    sums itself, ``rp`` padded LoRA rows at a time)."""
    m, k, r_total = x2.shape[0], x2.shape[1], a.shape[0]
    upcast = _interpreting()  # the interpreter's 16-bit tl.dot returns garbage (Triton 3.6-3.9): fp32 there
    prec = "ieee" if x2.dtype == torch.float32 or upcast else "tf32"
    bm = min(64, max(16, triton.next_power_of_2(m)))
    m_blocks = triton.cdiv(m, bm)
    r_blocks = triton.cdiv(r_total, _BR)
    # about 512 fp32 partial rows per output row block: enough K splits to fill the GPU at one row, few enough that
    # the expand's re-reads of the partials stay small at 64
    k_blocks = triton.cdiv(k, bk)
    splits_wanted = max(1, min(k_blocks, 512 // bm))
    k_chunk = triton.cdiv(k_blocks, splits_wanted) * bk
    splits = triton.cdiv(k, k_chunk)
    partials = torch.empty((splits, m, r_total), device=x2.device, dtype=torch.float32)
    if serial and semaphores.numel() < r_blocks * m_blocks:
        raise ValueError(f"the serial shrink needs {r_blocks * m_blocks} zeroed int32 semaphores")
    shrunk = torch.empty((m, r_total), device=x2.device, dtype=x2.dtype) if serial else partials
    sc = max(1, min(triton.next_power_of_2(splits), 4096 // (bm * (_BR if serial else rp))))  # partials per sum step
    _shrink_launch((splits, r_blocks, m_blocks),
                   (x2, a, partials, shrunk, semaphores, m, k, r_total, x2.stride(0), a.stride(0), splits),
                   ("shrink", k_chunk, bm, bk, sc, prec, upcast, serial),
                   dict(K_CHUNK=k_chunk, BM=bm, BR=_BR, BK=bk, SC=sc, PREC=prec, UPCAST=upcast, SERIAL=serial))  # fmt: skip
    return partials, shrunk, splits, sc


def _launch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, rank: int,
            variant: str | None = None, bn: int = _BN, bk: int = _BK, semaphores: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    n, k = y.shape[-1], x.shape[-1]
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("lora_delta_add: the LoRA buffers A and B must be row-major (contiguous rows).")
    x2, y2 = x.reshape(-1, k), y.reshape(-1, n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y2 = y2 if y2.stride(-1) == 1 else y2.contiguous()
    m, r_total = x2.shape[0], a.shape[0]
    slots = r_total // rank
    semaphores = bounds[slots + 1 :] if semaphores is None else semaphores
    upcast = _interpreting()  # as in _shrink
    prec = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    bm = min(64, max(16, triton.next_power_of_2(m)))
    m_blocks = triton.cdiv(m, bm)
    rp = max(16, triton.next_power_of_2(rank))
    r_blocks = triton.cdiv(r_total, _BR)
    if variant is None:  # the serial pair where it wins and the layer has semaphores enough (ranks up to 1024)
        variant = "serial" if n >= SERIAL_MIN_COLS and semaphores.numel() >= r_blocks * m_blocks else "split"
    out = torch.empty_like(y2)
    serial = variant == "serial"
    partials, shrunk, splits, sc = _shrink(x2, a, semaphores, bk, serial, rp)
    _expand_launch((triton.cdiv(n, bn), m_blocks),
                   (partials, shrunk, b, y2, out, bounds, m, n, r_total, splits, b.stride(0), y2.stride(0), out.stride(0)),
                   ("expand", slots, rank, rp, sc, bm, bn, prec, upcast, serial),
                   dict(S=slots, RANK=rank, RP=rp, SC=sc, BM=bm, BN=bn, PREC=prec, UPCAST=upcast, SERIAL=serial))  # fmt: skip
    return out.view(y.shape)


@torch.library.custom_op("qerl_trl::lora_delta_add", mutates_args=())
def lora_delta_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor,
                   rank: int) -> torch.Tensor:  # fmt: skip
    """``y + (x A^T) B^T`` for one single-LoRA layer (a new tensor).

    ``a``: ``[S*rank, K]`` (the S packed sub-modules' A stacked); ``b``: ``[N, S*rank]``, block-diagonal, of which
    only the diagonal blocks are read on the kernel path; ``bounds``: :func:`lora_slot_bounds` (on ``y``'s device).
    Up to :data:`KERNEL_MAX_ROWS` rows on a GPU (or under ``TRITON_INTERPRET=1``): the Triton pair; else two GEMMs.
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if _use_kernel(x, rows):
        return _launch(y, x, a, b, bounds, rank)
    return lora_delta_add_reference(y, x, a, b)


@lora_delta_add.register_fake
def _(y, x, a, b, bounds, rank):
    return torch.empty_like(y)
