"""The LoRA's expand inside Humming's GEMM (``vllm_lora_expand_in_gemm``): the packed LoRA ``B`` held as ``S*r``
extra input columns of a linear's NVFP4 weight, so that ``[x | x A^T] @ [W | B]^T`` adds the base and the LoRA in
one GEMM and no expand launch runs.

Written against vLLM 0.24.0 (``HummingLinearMethod``: the compressed-tensors parameters it loads,
``input_size_per_partition``, ``pad_k_to_multiple=128``) and humming-kernels 0.1.19 (``layer.humming_metas``,
``transform_humming_tensors``). This is the one place that reaches into them.

Why the tail can be rewritten alone (Humming 0.1.19's source, ``docs/vllm.md``): the weight repack packs each
64 x 64 (n, k) block on its own into rows ``k/16 ..`` of its output, and the scale transform turns ``[N, K/16]``
into ``[K/16, N]`` with a permutation inside 64-column blocks. So with ``K`` a multiple of 128, the columns
``K ..`` are the last rows of both transformed tensors, and a sync transforms only ``B``'s block and copies it over
them. Each sync quantizes ``B`` against the second scale Humming holds for each row (:func:`quantize_rows`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from qerl_trl.nvfp4.format import BLOCK_SIZE, quantize_rows

__all__ = ["TAIL_ALIGN", "expand_in_gemm_layers", "expand_in_gemm_problem", "lora_tail_meta", "tail_width",
           "widen_for_lora_tail", "write_lora_tail"]

#: vLLM 0.24 pads a Humming linear's input width to a multiple of this (``pad_k_to_multiple=128``); the tail starts
#: on such a boundary, where the repacked rows and the transformed scales of the base end.
TAIL_ALIGN = 128


def tail_width(total_rank: int) -> int:
    """The extra input columns for ``S*r`` LoRA rows: rounded up to an NVFP4 block (16), the pad columns zero."""
    return -(-int(total_rank) // BLOCK_SIZE) * BLOCK_SIZE


def expand_in_gemm_problem(fp4_kernel: str, in_features: int) -> str | None:
    """Why a layer cannot take its LoRA's expand inside the FP4 GEMM (it then runs the two-launch pair), or None.
    ``fp4_kernel``: the layer's ``qerl_fp4_kernel``; ``in_features``: its input width on this rank."""
    if fp4_kernel != "humming":
        return f"its FP4 GEMM is {fp4_kernel!r}, not Humming"
    if in_features % TAIL_ALIGN:
        return f"its input width on this rank ({in_features}) is not a multiple of {TAIL_ALIGN}"
    return None


def expand_in_gemm_layers(model: nn.Module) -> dict[str, str | None]:
    """``{single-LoRA layer: None where its LoRA's expand runs inside Humming's GEMM, else why not}`` in a vLLM model
    built with ``vllm_lora_expand_in_gemm`` (for the trainer's log: the option does nothing on a Marlin layer)."""
    return {name: (None if module.qerl_expand_in_gemm else module.qerl_expand_in_gemm_why)
            for name, module in model.named_modules() if hasattr(module, "qerl_expand_in_gemm")}  # fmt: skip


def _row_second_scales(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per-row float32 [N], the weight_scale_2 Humming builds)`` from the layer's loaded ``weight_global_scale``
    (one per packed shard): ``1 / gs`` of each row's shard, as Humming's compressed-tensors schema converts it (one
    float32 value when the shards agree; else one per row in the layer's dtype, and rounded to it)."""
    gs = layer.weight_global_scale.data.to(torch.float32).reshape(-1)
    sizes = list(layer.output_partition_sizes)
    inv = 1.0 / gs
    if len(gs) == 1 or bool((gs == gs[0]).all()):
        rows = inv[:1].expand(sum(sizes)).clone()
        return rows, inv[:1].clone()
    if len(gs) != len(sizes):
        raise ValueError(f"{len(gs)} global scales for {len(sizes)} packed shards: not a compressed-tensors NVFP4 "
                         "layer")
    dtype = getattr(layer, "param_dtype", None) or layer.qerl_lora_b.dtype  # vLLM's Humming method sets it
    per_row = inv.repeat_interleave(torch.tensor(sizes, device=gs.device)).to(dtype)
    return per_row.to(torch.float32), per_row


def widen_for_lora_tail(layer: nn.Module, width: int) -> int:
    """Before Humming converts the loaded checkpoint tensors: append ``width`` (:func:`tail_width`) zero input
    columns to the NVFP4 weight and its block scales (so B starts as zeros and the GEMM is the base's), record each
    row's second scale for the syncs, and return the layer's own input width. The caller sets
    ``input_size_per_partition`` to the widened width while Humming processes the layer."""
    in_features = int(layer.input_size_per_partition)
    for name in ("weight_packed", "weight_scale"):
        param = getattr(layer, name)
        data = param.data
        cols = data.shape[1]
        if (width * cols) % in_features:
            raise ValueError(f"{name} has {cols} columns for {in_features} inputs: cannot widen it by {width}")
        raw = data.view(torch.uint8)  # e4m3 zero is byte 0; works for float8 where cat may not
        pad = raw.new_zeros((raw.shape[0], width * cols // in_features))
        param.data = torch.cat([raw, pad], dim=1).view(data.dtype)
    rows, scale_2 = _row_second_scales(layer)
    layer.register_buffer("qerl_tail_row_scale", rows, persistent=False)
    layer.qerl_tail_scale_2 = scale_2
    layer.qerl_in_features = in_features
    return in_features


def lora_tail_meta(layer: nn.Module) -> object:
    """Humming's layer meta for the tail alone: the layer's, with its width the tail's (after Humming processed it)
    and no bias. The layer's bias is added once, by its own GEMM; a meta that kept ``has_bias`` made Humming's
    transform demand a ``bias`` tensor for the tail (Qwen2.5's q/k/v, found on an H100 at b557732)."""
    meta = layer.humming_metas[""]
    return dataclasses.replace(meta, shape_k=meta.shape_k - layer.qerl_in_features, has_bias=False)


def write_lora_tail(layer: nn.Module) -> torch.Tensor:
    """Quantize the layer's ``qerl_lora_b`` (block-diagonal, scaling folded in) and write it over the tail of its
    Humming weight and scales. Returns whether a block saturated (0-dim bool on the device)."""
    from humming.transform import transform_humming_tensors

    b = layer.qerl_lora_b
    b = torch.nn.functional.pad(b, (0, tail_width(b.shape[1]) - b.shape[1]))  # the pad columns: zero codes
    packed, scales, saturated = quantize_rows(b, layer.qerl_tail_row_scale)
    tensors = {"weight": packed.view(torch.int32), "weight_scale": scales, "weight_scale_2": layer.qerl_tail_scale_2}
    out = transform_humming_tensors(layer.qerl_tail_meta, tensors)
    for name in ("weight", "weight_scale"):
        tail = out[name]
        dst = getattr(layer, name).data
        dst[dst.shape[-2] - tail.shape[-2] :].copy_(tail.view(dst.dtype) if tail.dtype != dst.dtype else tail)
    return saturated
