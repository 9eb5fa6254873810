"""Where one LoRA's A and B rows live in a tensor-parallel vLLM linear layer: plain functions, no vLLM imports.

A vLLM linear layer can pack several of the model's linears (``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up)
and holds only its tensor-parallel shard. The single-LoRA path keeps, per layer, one ``lora_a`` of
``[S * r, in_local]`` (the S packed sub-modules' A matrices stacked: one shrink GEMM over their shared input) and
one ``lora_b`` of ``[out_local, S * r]`` whose diagonal blocks hold each sub-module's B (scaled by the LoRA
scaling) and whose off-diagonal blocks stay zero (one expand GEMM). Then ``y += (x @ lora_a.T) @ lora_b.T`` is the
LoRA of every sub-module at once.

Sharding, with the full (trainer) matrices A ``[r, in]`` and B ``[out, r]``:

* column-parallel (q/k/v, gate/up, any ColumnParallelLinear): A is whole on every rank; B's rows are the rank's
  output shard. K/V heads replicated over ranks (TP > num_kv_heads) take shard ``tp_rank // replicas``;
* row-parallel (o_proj, down_proj): A's columns are the rank's input shard and B is whole. The layer all-reduces
  its partial outputs afterwards, so expanding each rank's partial shrink before that reduction is exact:
  ``sum_k (x_k A_k^T) B^T = (x A^T) B^T``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["LoRASlot", "LoRAShardPlan", "column_parallel_plan", "row_parallel_plan", "fill_lora_buffers"]


@dataclass(frozen=True)
class LoRASlot:
    """One sub-module (``q_proj``, ``gate_proj``, ...) of a vLLM linear layer, on this tensor-parallel rank."""

    name: str
    out_start: int  # first row of the sub-module in the layer's local output
    out_rows: int  # its rows on this rank
    src_out_start: int  # the first of those rows in the full (trainer) weight, i.e. in B


@dataclass(frozen=True)
class LoRAShardPlan:
    """The LoRA layout of one vLLM linear layer on one rank (see the module docstring)."""

    slots: tuple[LoRASlot, ...]
    rank: int
    in_start: int  # first input column on this rank (row-parallel shards); 0 when the input is whole
    in_cols: int

    @property
    def total_rank(self) -> int:
        return self.rank * len(self.slots)

    @property
    def out_rows(self) -> int:
        return sum(s.out_rows for s in self.slots)

    def buffer_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Shapes of ``lora_a`` and ``lora_b``."""
        return (self.total_rank, self.in_cols), (self.out_rows, self.total_rank)


def column_parallel_plan(
    names: Sequence[str],
    output_partition_sizes: Sequence[int],
    input_size: int,
    rank: int,
    shard_indices: Sequence[int],
) -> LoRAShardPlan:
    """Plan of a column-parallel layer whose local output packs ``names`` with ``output_partition_sizes`` rows.

    ``shard_indices[i]``: which equal shard of sub-module ``i``'s full output this rank holds (``tp_rank``, or
    ``tp_rank // num_kv_head_replicas`` for replicated K/V heads).
    """
    if not (len(names) == len(output_partition_sizes) == len(shard_indices)) or not names:
        raise ValueError(
            f"column_parallel_plan: {len(names)} names, {len(output_partition_sizes)} output partitions and "
            f"{len(shard_indices)} shard indices must be equal and non-zero."
        )
    _check_rank(rank)
    slots, start = [], 0
    for name, rows, shard in zip(names, output_partition_sizes, shard_indices, strict=True):
        slots.append(LoRASlot(name, start, int(rows), int(shard) * int(rows)))
        start += int(rows)
    return LoRAShardPlan(tuple(slots), rank, 0, int(input_size))


def row_parallel_plan(name: str, output_size: int, input_size_per_partition: int, tp_rank: int, rank: int) -> LoRAShardPlan:
    """Plan of a row-parallel layer: whole output, this rank's ``input_size_per_partition`` input columns."""
    _check_rank(rank)
    in_cols = int(input_size_per_partition)
    return LoRAShardPlan((LoRASlot(name, 0, int(output_size), 0),), rank, int(tp_rank) * in_cols, in_cols)


def _check_rank(rank: int) -> None:
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}.")


@torch.no_grad()
def fill_lora_buffers(
    plan: LoRAShardPlan,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    scaling: float,
) -> list[str]:
    """Copy, in place, the full ``(A [r, in], B [out, r])`` of each sub-module in ``adapters`` (keyed by slot name)
    into this rank's ``lora_a`` / ``lora_b``; a sub-module missing from ``adapters`` gets zeros (no LoRA there).

    In place, so the buffers keep their addresses: CUDA graphs and compiled graphs that captured them see the new
    adapter. ``scaling`` (PEFT's ``lora_alpha / r``) is folded into B. Returns the slot names filled.
    """
    (ra, ca), (rb, cb) = plan.buffer_shapes()
    if tuple(lora_a.shape) != (ra, ca) or tuple(lora_b.shape) != (rb, cb):
        raise ValueError(
            f"LoRA buffers are {tuple(lora_a.shape)} / {tuple(lora_b.shape)}, the plan needs {(ra, ca)} / {(rb, cb)}."
        )
    unknown = set(adapters) - {s.name for s in plan.slots}
    if unknown:
        raise KeyError(f"No LoRA slot for {sorted(unknown)} in this layer (slots: {[s.name for s in plan.slots]}).")
    r = plan.rank
    filled = []
    for i, slot in enumerate(plan.slots):
        cols = slice(i * r, (i + 1) * r)
        rows = slice(slot.out_start, slot.out_start + slot.out_rows)
        pair = adapters.get(slot.name)
        if pair is None:
            lora_a[cols].zero_()
            lora_b[rows, cols].zero_()
            continue
        a, b = pair
        src_rows = slot.src_out_start + slot.out_rows
        if a.dim() != 2 or a.shape[0] != r or a.shape[1] < plan.in_start + plan.in_cols:
            raise ValueError(
                f"LoRA A of {slot.name!r} is {tuple(a.shape)}; this layer needs rank {r} and at least "
                f"{plan.in_start + plan.in_cols} input columns (is the engine's LoRA rank the trainer's?)."
            )
        if b.dim() != 2 or b.shape[1] != r or b.shape[0] < src_rows:
            raise ValueError(
                f"LoRA B of {slot.name!r} is {tuple(b.shape)}; this layer needs rank {r} and at least {src_rows} "
                "output rows."
            )
        lora_a[cols].copy_(a[:, plan.in_start : plan.in_start + plan.in_cols])
        src = b[slot.src_out_start : src_rows]
        lora_b[rows, cols].copy_(src.to(torch.promote_types(src.dtype, torch.float32)) * scaling)  # scale in fp32
        filled.append(slot.name)
    return filled
