"""The single-LoRA delta ``y += (x A^T) B^T`` of one vLLM linear layer, in two Triton launches, the first beside the
base GEMM (no vLLM imports).

Why: an RL rollout decodes 1-256 sequences per engine, so each LoRA'd linear sees that many rows. There the two
GEMMs of the plain formulation are latency, not bytes: at Qwen2.5-7B shapes, r=32, the LoRA's A and B are 4% of
the NVFP4 base's bytes, yet on an H100 at 64 rows the two cuBLAS GEMMs per linear cost 31% of the decode step on
Humming (``benchmarks/results/rollout-h100.json``, run db1167's profile). Half of that is the shrink, which waits
for nothing the base GEMM computes. So the layer runs:

1. :func:`lora_shrink` (before the base GEMM): ``x A^T`` on a side CUDA stream, split over K into fp32 partials
   that the last program of each block sums in split order (a semaphore), into the finished ``[rows, S*r]`` in
   the activation dtype, as the plain path's bf16 GEMM rounds it;
2. the base NVFP4 GEMM on the main stream, beside it;
3. :func:`lora_expand_` (after it): the main stream waits for the side stream, then one launch adds
   ``shrunk_j @ B_j^T`` to ``y`` in place, reading only the diagonal block ``B_j`` of each output slot ``j``
   (packed q/k/v or gate/up), not the block-diagonal ``B`` whose zeros are S times the bytes it needs.

The side stream joins vLLM's CUDA graph capture like any fork/join: the graph gets two branches. Both ops are
``torch.library`` custom ops, opaque to torch.compile (vLLM compiles the model). :func:`lora_expand_` takes ``x``
although it does not read it: that keeps ``x``'s buffer alive, in the compiler's memory plan, until the side stream
is done reading it. Above :data:`KERNEL_MAX_ROWS` rows (prefill) both are cuBLAS GEMMs in line, the second into
``y`` in place. Each layer owns its scratch (:func:`lora_partials`, the semaphores at the tail of
:func:`lora_slot_bounds`), and every shrink runs on the one side stream, so no two shrinks share scratch at once.
The semaphores go back to zero; the partials are scratch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qerl_trl.nvfp4._launch import KernelLauncher
from qerl_trl.nvfp4.triton_kernels import _interpreting

__all__ = [
    "KERNEL_MAX_ROWS",
    "lora_delta_add_reference",
    "lora_expand_",
    "lora_partials",
    "lora_shrink",
    "lora_slot_bounds",
]

#: Rows (tokens) up to which the Triton pair runs (the shrink beside the base GEMM); above it, two cuBLAS GEMMs in
#: line. Decode batches of a GRPO rollout are 1-256 rows per engine; prefill is more.
KERNEL_MAX_ROWS = 256
_BK = 128  # shrink: K per inner step
_BR = 32  # shrink: LoRA rows (of S*r) per program
_BN = 64  # expand: output columns per program
_BM_MAX = 64  # rows per program, both kernels
#: fp32 partial rows per LoRA row in a layer's scratch: the shrink splits K into at most this many partial rows per
#: output row block (enough programs to fill the GPU at one row, few enough to sum quickly at 256)
PARTIAL_ROWS = 512


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, p_ptr, s_ptr, sem_ptr, M, K, R, stride_xm, stride_am, SPLITS,
                        K_CHUNK: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, SC: tl.constexpr,
                        PREC: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """Partial ``x[:, chunk] @ A[:, chunk]^T`` of one K chunk, one block of rows and one block of LoRA rows, stored
    in ``p``. The last program of each (row, LoRA-row) block to finish (a semaphore) sums the block's partials in
    split order into ``s``, rounded to ``s``'s dtype, and resets the semaphore to zero."""
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
def _lora_expand_kernel(s_ptr, b_ptr, y_ptr, bounds_ptr, M, N, R, stride_bn, stride_ym, S: tl.constexpr,
                        RANK: tl.constexpr, RP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
                        UPCAST: tl.constexpr):  # fmt: skip
    """``y += s_j @ B_j^T`` in place on one block of output columns, ``j`` the slot (packed sub-module) of each
    column: columns ``bounds[j] <= n < bounds[j+1]`` use LoRA rows ``j*RANK ..`` of ``s`` ``[M, R]`` and of ``B``."""
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
            s = tl.load(s_ptr + rm[:, None] * R + j * RANK + rj[None, :], mask=(rm[:, None] < M) & (rj[None, :] < RANK),
                        other=0.0)  # fmt: skip
            if UPCAST:
                s = s.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(s, b, input_precision=PREC)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], (y.to(tl.float32) + acc).to(y.dtype), mask=ymask)


_shrink_launch = KernelLauncher(_lora_shrink_kernel)
_expand_launch = KernelLauncher(_lora_expand_kernel)


def _row_blocks(m: int) -> tuple[int, int]:
    """``(rows per program, row blocks)`` at ``m`` rows."""
    bm = min(_BM_MAX, max(16, triton.next_power_of_2(m)))
    return bm, triton.cdiv(m, bm)


def semaphores_needed(total_rank: int) -> int:
    """The shrink's semaphores for a layer of ``total_rank`` (= S*r) LoRA rows: one per (row block, LoRA-row block)
    at :data:`KERNEL_MAX_ROWS` rows."""
    return triton.cdiv(total_rank, _BR) * _row_blocks(KERNEL_MAX_ROWS)[1]


def lora_slot_bounds(slot_starts: list[int], out_rows: int, total_rank: int, device: torch.device | str | None = None
                     ) -> torch.Tensor:  # fmt: skip
    """``int32 [S+1+semaphores]``: where each packed sub-module's output rows start in the layer's local output, the
    end, then zeros: the shrink's per-block semaphores (:func:`semaphores_needed`), which it leaves at zero. One
    such buffer per layer, so no two layers share a semaphore."""
    bounds = [int(s) for s in slot_starts] + [int(out_rows)]
    if bounds != sorted(bounds) or bounds[0] != 0:
        raise ValueError(f"LoRA slot starts must rise from 0 to the output size, got {bounds}.")
    return torch.tensor(bounds + [0] * semaphores_needed(total_rank), dtype=torch.int32, device=device)


def lora_partials(total_rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A layer's fp32 scratch for the shrink's partial sums (``PARTIAL_ROWS * total_rank``; 192 KiB for Qwen2.5's
    q/k/v at r=32). Per layer and allocated with its weights, so it has one address for CUDA graphs and survives
    vLLM's sleep mode with them."""
    return torch.zeros(PARTIAL_ROWS * total_rank, dtype=torch.float32, device=device)


def lora_delta_add_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The plain formulation: ``y + (x A^T) B^T`` with the block-diagonal ``B``, two GEMMs (a new tensor)."""
    shrunk = torch.matmul(x, a.t())
    return torch.addmm(y.reshape(-1, y.shape[-1]), shrunk.reshape(-1, shrunk.shape[-1]), b.t()).view(y.shape)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _use_kernel(x: torch.Tensor) -> bool:
    return 0 < _rows(x) <= KERNEL_MAX_ROWS and (x.is_cuda or _interpreting())


def _precision(dtype: torch.dtype) -> tuple[str, bool]:
    """``(tl.dot input precision, upcast to fp32)``: the interpreter's 16-bit tl.dot returns garbage (Triton
    3.6-3.9), so it computes in fp32 there."""
    upcast = _interpreting()
    return ("ieee" if dtype == torch.float32 or upcast else "tf32"), upcast


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
#: ``QERL_LORA_OVERLAP=0`` runs the shrink in line on the main stream (for A/B measurements of the overlap)
OVERLAP = os.environ.get("QERL_LORA_OVERLAP", "1") != "0"


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every shrink on ``device`` runs on (one per device, high priority: the expand waits for it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index, priority=-1)
    return stream


def _check_row_major(*buffers: torch.Tensor) -> None:
    if any(t.stride(-1) != 1 for t in buffers):
        raise ValueError("The single-LoRA ops need the LoRA buffers A and B row-major (contiguous rows).")


def _launch_shrink(x2: torch.Tensor, a: torch.Tensor, semaphores: torch.Tensor, partials: torch.Tensor,
                   shrunk: torch.Tensor) -> None:  # fmt: skip
    m, k, r_total = x2.shape[0], x2.shape[1], a.shape[0]
    prec, upcast = _precision(x2.dtype)
    bm, m_blocks = _row_blocks(m)
    r_blocks = triton.cdiv(r_total, _BR)
    k_blocks = triton.cdiv(k, _BK)
    splits_wanted = max(1, min(k_blocks, PARTIAL_ROWS // (bm * m_blocks)))
    k_chunk = triton.cdiv(k_blocks, splits_wanted) * _BK
    splits = triton.cdiv(k, k_chunk)
    if semaphores.numel() < r_blocks * m_blocks or partials.numel() < splits * m * r_total:
        raise ValueError(f"This layer's LoRA scratch is too small for {m} rows at LoRA width {r_total}: build it with "
                         "lora_slot_bounds(..., total_rank) and lora_partials(total_rank).")  # fmt: skip
    sc = max(1, min(triton.next_power_of_2(splits), 4096 // (bm * _BR)))  # partials per summing step
    _shrink_launch((splits, r_blocks, m_blocks),
                   (x2, a, partials, shrunk, semaphores, m, k, r_total, x2.stride(0), a.stride(0), splits),
                   ("shrink", k_chunk, bm, sc, prec, upcast),
                   dict(K_CHUNK=k_chunk, BM=bm, BR=_BR, BK=_BK, SC=sc, PREC=prec, UPCAST=upcast))  # fmt: skip


@torch.library.custom_op("qerl_trl::lora_shrink", mutates_args=())
def lora_shrink(x: torch.Tensor, a: torch.Tensor, bounds: torch.Tensor, partials: torch.Tensor, rank: int
                ) -> torch.Tensor:  # fmt: skip
    """``x A^T`` ``[rows, S*rank]`` in ``x``'s dtype: call it before the base GEMM. On a GPU, up to
    :data:`KERNEL_MAX_ROWS` rows, the kernel is only launched here, on the side stream (:func:`lora_expand_` waits
    for it); ``bounds`` and ``partials``: the layer's scratch (:func:`lora_slot_bounds`, :func:`lora_partials`)."""
    _check_row_major(a)
    x2 = x.reshape(-1, x.shape[-1])
    if not _use_kernel(x):
        return torch.matmul(x2, a.t())
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    shrunk = torch.empty((x2.shape[0], a.shape[0]), device=x.device, dtype=x.dtype)
    semaphores = bounds[a.shape[0] // rank + 1 :]
    if not x.is_cuda or not OVERLAP:  # the interpreter: in line
        _launch_shrink(x2, a, semaphores, partials, shrunk)
        return shrunk
    side = _side_stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        _launch_shrink(x2, a, semaphores, partials, shrunk)
    return shrunk


@lora_shrink.register_fake
def _(x, a, bounds, partials, rank):
    return x.new_empty((x.numel() // x.shape[-1], a.shape[0]))


@torch.library.custom_op("qerl_trl::lora_expand_", mutates_args=("y",))
def lora_expand_(y: torch.Tensor, x: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor,
                 rank: int) -> None:  # fmt: skip
    """``y += shrunk @ B^T`` in place, after the base GEMM wrote ``y``; ``shrunk`` is :func:`lora_shrink`'s of ``x``
    (passed so that its buffer lives until the side stream is done). ``b``: ``[N, S*rank]``, block-diagonal, of which
    only the diagonal blocks are read on the kernel path."""
    _check_row_major(b)
    n = y.shape[-1]
    if not _use_kernel(x):
        if y.is_contiguous():
            y.view(-1, n).addmm_(shrunk, b.t())
        else:
            y.copy_(torch.addmm(y.reshape(-1, n), shrunk, b.t()).view(y.shape))
        return
    if x.is_cuda and OVERLAP:
        torch.cuda.current_stream(x.device).wait_stream(_side_stream(x.device))
    y2 = y.view(-1, n)
    if y2.stride(-1) != 1:
        raise ValueError("lora_expand_ needs the base GEMM's output with contiguous rows.")
    m, r_total = y2.shape[0], shrunk.shape[1]
    prec, upcast = _precision(y.dtype)
    bm, m_blocks = _row_blocks(m)
    rp = max(16, triton.next_power_of_2(rank))
    slots = r_total // rank
    _expand_launch((triton.cdiv(n, _BN), m_blocks),
                   (shrunk, b, y2, bounds, m, n, r_total, b.stride(0), y2.stride(0)),
                   ("expand", slots, rank, rp, bm, prec, upcast),
                   dict(S=slots, RANK=rank, RP=rp, BM=bm, BN=_BN, PREC=prec, UPCAST=upcast))  # fmt: skip


@lora_expand_.register_fake
def _(y, x, shrunk, b, bounds, rank):
    return None
