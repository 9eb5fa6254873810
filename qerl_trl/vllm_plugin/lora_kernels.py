"""The single-LoRA delta ``y += (x A^T) B^T`` of one vLLM linear layer in two Triton launches (no vLLM imports).

Why: an RL rollout decodes 1-128 sequences per engine, so each LoRA'd linear sees that many rows. There the two
GEMMs of the plain formulation are latency, not bytes: at Qwen2.5-7B shapes, r=32, the LoRA's A and B are 4% of
the NVFP4 base's bytes, yet at 64 rows two cuBLAS GEMMs per linear, plus the copy of ``y`` that an out-of-place
``addmm`` makes, cost 1.49 ms of a decode step (``benchmarks/results/lora_delta-h100.json``). So the layer runs:

1. :func:`lora_shrink` (before the base GEMM): ``x A^T``, split over K into fp32 partials (enough programs to fill
   the GPU at one row); the last program of each block to finish (a semaphore) sums them in split order into the
   finished ``[rows, S*r]``, rounded to the activation dtype as the plain path's bf16 GEMM rounds it;
2. the base NVFP4 GEMM;
3. :func:`lora_expand_` (after it): one launch adds ``shrunk_j @ B_j^T`` to ``y`` in place, reading only the
   diagonal block ``B_j`` of each output slot ``j`` (packed q/k/v or gate/up), not the block-diagonal ``B`` whose
   zeros are S times the bytes it needs.

That is the serial pair. At up to :data:`SPLIT_MAX_ROWS` rows, layers narrower than :data:`SERIAL_MIN_COLS`
(qkv, o, down) take the split pair instead: the shrink only writes the partials, and each expand program sums its
slot's partials itself, which is one dependent step less where the expand has few programs.

Per 7B decode step on the H100 (``lora_delta-h100.json``, graph-timed, each row against cuBLAS in its own call):
the serial pair's LoRA takes 1.34 / 1.63 ms at 64 / 128 rows against 1.49 / 1.70 ms for the two GEMMs and the
copy; the split/serial mix 0.92 / 1.04 ms at 1 / 16 rows against 1.36 / 1.33 ms. Above :data:`KERNEL_MAX_ROWS`
rows (prefill) both are cuBLAS GEMMs, the second into ``y`` in place. Running the shrink on a side stream beside
the base GEMM was measured too: it won beside a cuBLAS GEMM but not beside Humming in a real engine (7B rollouts,
``rollout_lora_overlap-h100.json``), so it is not done.

Both ops are ``torch.library`` custom ops, opaque to torch.compile (vLLM compiles the model); the expand is
declared to mutate ``y``, and Inductor runs it on the base GEMM's output buffer itself, with no copy
(``tests/test_lora_kernels.py``, on CPU). Both are
deterministic, need no host sync and have fixed launch shapes per row count (CUDA-graph safe). Each layer owns
its scratch (:func:`lora_partials`, and the semaphores at the tail of :func:`lora_slot_bounds`, which go back to
zero); vLLM runs a model on one stream, so a layer's shrink never runs concurrently with itself.
"""

from __future__ import annotations

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
    "lora_shrink_concat",
    "lora_slot_bounds",
]

#: Rows (tokens) up to which the Triton pair runs; above it, two cuBLAS GEMMs. From ``lora_delta-h100.json`` (7B,
#: one call): per decode step the pair's LoRA took 1.63 ms at 128 rows against cuBLAS's 1.70, and 2.43 against 2.12
#: at 256 (``down_proj``'s long-K shrink has too few programs there).
KERNEL_MAX_ROWS = 128
_BK = 128  # shrink: K per inner step
_BR = 32  # shrink: LoRA rows (of S*r) per program
_BN = 64  # expand: output columns per program
_BM_MAX = 64  # rows per program, both kernels
#: Up to this many rows, layers narrower than :data:`SERIAL_MIN_COLS` take the split pair: the shrink only writes
#: its partials, and each expand program sums those of its slot itself (no semaphore wait, one step less in series)
SPLIT_MAX_ROWS = 16
#: Output columns from which the serial pair beats the split pair at 1-16 rows. Qwen2.5 7B-32B gate/up has
#: 37888-55296 columns: 9.8-10.9 µs against 12.6-18.1 µs there, where its 600-900 expand programs would each
#: re-sum the partials; qkv, o and down have 3584-7168 columns, where the split pair is 1.4-2.2 µs faster
#: (``lora_delta-h100.json`` at 5005a69).
SERIAL_MIN_COLS = 16384
#: fp32 partial rows per LoRA row in a layer's scratch: the shrink splits K into at most this many partial rows per
#: output row block (enough programs to fill the GPU at one row, few enough to sum quickly at 128)
PARTIAL_ROWS = 512


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, p_ptr, s_ptr, sem_ptr, M, K, R, stride_xm, stride_am, stride_sm, SPLITS,
                        K_CHUNK: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, SC: tl.constexpr,
                        PREC: tl.constexpr, UPCAST: tl.constexpr, SERIAL: tl.constexpr,
                        COPY_X: tl.constexpr):  # fmt: skip
    """Partial ``x[:, chunk] @ A[:, chunk]^T`` of one K chunk, one block of rows and one block of LoRA rows, stored
    in ``p``. ``SERIAL``: the last program of each (row, LoRA-row) block to finish (a semaphore) also sums the
    block's partials in split order into ``s`` (rows ``stride_sm`` apart), rounded to ``s``'s dtype, and resets the
    semaphore to zero. ``COPY_X``: ``s`` is the last ``R`` columns of ``[x | s]`` (the expand-in-GEMM input), and
    the programs of the first LoRA-row block also copy their chunk of ``x`` into its first ``K`` columns."""
    pid_k = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rr = pid_r * BR + tl.arange(0, BR)
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    for k0 in range(0, K_CHUNK, BK):
        rk = pid_k * K_CHUNK + k0 + tl.arange(0, BK)
        xmask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=xmask, other=0.0)
        a = tl.load(a_ptr + rr[None, :] * stride_am + rk[:, None], mask=(rr[None, :] < R) & (rk[:, None] < K), other=0.0)
        if COPY_X:
            if pid_r == 0:
                tl.store(s_ptr - K + rm[:, None] * stride_sm + rk[None, :], x, mask=xmask)
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
            tl.store(s_ptr + rm[:, None] * stride_sm + rr[None, :], tot.to(s_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(sem, 0)


@triton.jit
def _lora_expand_kernel(p_ptr, s_ptr, b_ptr, y_ptr, bounds_ptr, M, N, R, SPLITS, stride_bn, stride_ym,
                        S: tl.constexpr, RANK: tl.constexpr, RP: tl.constexpr, SC: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, SERIAL: tl.constexpr):  # fmt: skip
    """``y += s_j @ B_j^T`` in place on one block of output columns, ``j`` the slot (packed sub-module) of each
    column: columns ``bounds[j] <= n < bounds[j+1]`` use LoRA rows ``j*RANK ..`` of the shrink and of ``B``. The
    shrink is the finished ``s`` ``[M, R]`` (``SERIAL``) or the sum of the partials ``p``, rounded to the activation
    dtype."""
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


def _use_kernel(t2: torch.Tensor) -> bool:
    """Whether the Triton kernels take a 2-D ``[rows, ...]`` input (the shrink's ``x``, the expand's ``shrunk``: the
    same rows, so both ops decide alike)."""
    return 0 < t2.shape[0] <= KERNEL_MAX_ROWS and (t2.is_cuda or _interpreting())


def _precision(dtype: torch.dtype) -> tuple[str, bool]:
    """``(tl.dot input precision, upcast to fp32)``: the interpreter's 16-bit tl.dot returns garbage (Triton
    3.6-3.9), so it computes in fp32 there."""
    upcast = _interpreting()
    return ("ieee" if dtype == torch.float32 or upcast else "tf32"), upcast


def _check_row_major(*buffers: torch.Tensor) -> None:
    if any(t.stride(-1) != 1 for t in buffers):
        raise ValueError("The single-LoRA ops need the LoRA buffers A and B row-major (contiguous rows).")


def _serial(rows: int, out_features: int) -> bool:
    """Whether a layer of ``out_features`` columns at ``rows`` rows takes the serial pair (else the split pair)."""
    return rows > SPLIT_MAX_ROWS or out_features >= SERIAL_MIN_COLS


def _splits(m: int, k: int, bm: int, m_blocks: int) -> tuple[int, int]:
    """``(K splits, K per split)`` of the shrink: at most :data:`PARTIAL_ROWS` partial rows per row block."""
    k_blocks = triton.cdiv(k, _BK)
    splits_wanted = max(1, min(k_blocks, PARTIAL_ROWS // (bm * m_blocks)))
    k_chunk = triton.cdiv(k_blocks, splits_wanted) * _BK
    return triton.cdiv(k, k_chunk), k_chunk


def _launch_shrink(x2: torch.Tensor, a: torch.Tensor, semaphores: torch.Tensor, partials: torch.Tensor,
                   shrunk: torch.Tensor, serial: bool, copy_x: bool = False) -> None:  # fmt: skip
    """``copy_x``: ``shrunk`` is the last ``S*r`` columns of the ``[x | x A^T]`` buffer (:func:`lora_shrink_concat`)."""
    m, k, r_total = x2.shape[0], x2.shape[1], a.shape[0]
    prec, upcast = _precision(x2.dtype)
    bm, m_blocks = _row_blocks(m)
    r_blocks = triton.cdiv(r_total, _BR)
    splits, k_chunk = _splits(m, k, bm, m_blocks)
    if (serial and semaphores.numel() < r_blocks * m_blocks) or partials.numel() < splits * m * r_total:
        raise ValueError(f"This layer's LoRA scratch is too small for {m} rows at LoRA width {r_total}: build it with "
                         "lora_slot_bounds(..., total_rank) and lora_partials(total_rank).")  # fmt: skip
    sc = max(1, min(triton.next_power_of_2(splits), 4096 // (bm * _BR))) if serial else 1  # partials per summing step
    _shrink_launch((splits, r_blocks, m_blocks),
                   (x2, a, partials, shrunk, semaphores, m, k, r_total, x2.stride(0), a.stride(0), shrunk.stride(0),
                    splits),
                   ("shrink", k_chunk, bm, sc, prec, upcast, serial, copy_x),
                   dict(K_CHUNK=k_chunk, BM=bm, BR=_BR, BK=_BK, SC=sc, PREC=prec, UPCAST=upcast, SERIAL=serial,
                        COPY_X=copy_x))  # fmt: skip


@torch.library.custom_op("qerl_trl::lora_shrink", mutates_args=())
def lora_shrink(x: torch.Tensor, a: torch.Tensor, bounds: torch.Tensor, partials: torch.Tensor, rank: int,
                out_features: int) -> torch.Tensor:  # fmt: skip
    """The first of the pair, before the base GEMM: ``x A^T`` ``[rows, S*rank]`` in ``x``'s dtype, for
    :func:`lora_expand_`. ``a``: ``[S*rank, K]`` (the S packed sub-modules' A stacked); ``bounds`` and
    ``partials``: the layer's scratch (:func:`lora_slot_bounds`, :func:`lora_partials`); ``out_features``: the
    layer's output columns. Up to :data:`KERNEL_MAX_ROWS` rows on a GPU (or under ``TRITON_INTERPRET=1``) a Triton
    kernel, else a GEMM. In the split pair (narrow layers at up to :data:`SPLIT_MAX_ROWS` rows) the result is the
    fp32 partials left in ``partials``, and the returned tensor is left unwritten: it only orders the expand after
    this op for the compiler."""
    _check_row_major(a)
    x2 = x.reshape(-1, x.shape[-1])
    if not _use_kernel(x2):
        return torch.matmul(x2, a.t())
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    shrunk = torch.empty((x2.shape[0], a.shape[0]), device=x.device, dtype=x.dtype)
    _launch_shrink(x2, a, bounds[a.shape[0] // rank + 1 :], partials, shrunk, _serial(x2.shape[0], out_features))
    return shrunk


@lora_shrink.register_fake
def _(x, a, bounds, partials, rank, out_features):
    return x.new_empty((x.numel() // x.shape[-1], a.shape[0]))


@torch.library.custom_op("qerl_trl::lora_shrink_concat", mutates_args=())
def lora_shrink_concat(x: torch.Tensor, a: torch.Tensor, bounds: torch.Tensor, partials: torch.Tensor,
                       slots: int) -> torch.Tensor:  # fmt: skip
    """``[x | x A^T]`` ``[rows, K + R]`` in ``x``'s dtype, ``R`` = ``a``'s rows: the input of a layer whose FP4 GEMM
    holds the LoRA's ``B`` as ``R`` extra input columns (``vllm_lora_expand_in_gemm``), so that one GEMM adds the base
    and the LoRA delta and no expand runs. One launch up to :data:`KERNEL_MAX_ROWS` rows (the serial shrink, which
    also copies ``x``), else a GEMM and a copy. ``a``: the ``slots`` packed sub-modules' A stacked, maybe with zero
    rows after them (``R`` rounded up to an NVFP4 block); ``bounds`` (``slots + 1`` starts, then the semaphores) and
    ``partials``: the layer's scratch for ``R`` rows (:func:`lora_slot_bounds`, :func:`lora_partials`)."""
    _check_row_major(a)
    x2 = x.reshape(-1, x.shape[-1])
    k, r_total = x2.shape[1], a.shape[0]
    out = torch.empty((x2.shape[0], k + r_total), device=x.device, dtype=x.dtype)
    if not _use_kernel(x2):
        out[:, :k] = x2
        out[:, k:] = torch.matmul(x2, a.t())
        return out
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    _launch_shrink(x2, a, bounds[slots + 1 :], partials, out[:, k:], True, copy_x=True)
    return out


@lora_shrink_concat.register_fake
def _(x, a, bounds, partials, slots):
    return x.new_empty((x.numel() // x.shape[-1], x.shape[-1] + a.shape[0]))


@torch.library.custom_op("qerl_trl::lora_expand_", mutates_args=("y",))
def lora_expand_(y: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, partials: torch.Tensor,
                 rank: int, in_features: int) -> None:  # fmt: skip
    """The second of the pair, after the base GEMM wrote ``y``: ``y += (x A^T) B^T`` in place, from
    :func:`lora_shrink`'s result and the layer's ``partials``; ``in_features``: ``x``'s columns (K). ``b``:
    ``[N, S*rank]``, block-diagonal, of which only the diagonal blocks are read on the kernel path."""
    _check_row_major(b)
    n = y.shape[-1]
    if not _use_kernel(shrunk):
        if y.is_contiguous():
            y.view(-1, n).addmm_(shrunk, b.t())
        else:
            y.copy_(torch.addmm(y.reshape(-1, n), shrunk, b.t()).view(y.shape))
        return
    y2 = y.view(-1, n)
    if y2.stride(-1) != 1:
        raise ValueError("lora_expand_ needs the base GEMM's output with contiguous rows.")
    m, r_total = y2.shape[0], shrunk.shape[1]
    prec, upcast = _precision(y.dtype)
    bm, m_blocks = _row_blocks(m)
    rp = max(16, triton.next_power_of_2(rank))
    slots = r_total // rank
    serial = _serial(m, n)
    splits = _splits(m, in_features, bm, m_blocks)[0]
    sc = 1 if serial else max(1, min(triton.next_power_of_2(splits), 4096 // (bm * rp)))  # partials per summing step
    _expand_launch((triton.cdiv(n, _BN), m_blocks),
                   (partials, shrunk, b, y2, bounds, m, n, r_total, splits, b.stride(0), y2.stride(0)),
                   ("expand", slots, rank, rp, sc, bm, prec, upcast, serial),
                   dict(S=slots, RANK=rank, RP=rp, SC=sc, BM=bm, BN=_BN, PREC=prec, UPCAST=upcast, SERIAL=serial))  # fmt: skip


@lora_expand_.register_fake
def _(y, shrunk, b, bounds, partials, rank, in_features):
    return None
