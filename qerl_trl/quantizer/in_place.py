"""Quantize a model already in memory, in place (the same plan and shared scales as ``NVFP4Config`` on load)."""

from __future__ import annotations

import torch
from torch import nn

from ..nvfp4 import NVFP4Linear
from ..nvfp4.experts import NVFP4Experts
from ..nvfp4.linear import ACTIVATION_DTYPES
from . import conversion
from .checkpoint import compressed_tensors_config
from .config import NVFP4Config
from .conversion import ConversionPlan, plan_conversion
from .moe import ROUTER_IGNORE, beside_experts, check_expert_layout, fused_experts


def quantize_model(model: nn.Module, config: NVFP4Config | None = None) -> ConversionPlan:
    """Quantize an already-loaded 16-bit model in place, one fused group at a time; return the plan.

    Same rules and shared scales as loading with ``NVFP4Config``. Each group's ``nn.Linear`` modules are
    replaced by their ``NVFP4Linear`` as soon as the group is packed, so their 16-bit weights are freed (unless
    the caller holds other references): peak memory is the model plus one group's packed copy, never a second
    model. ``model.config.quantization_config`` becomes the compressed-tensors NVFP4A16 dict, so
    ``save_pretrained`` writes a checkpoint vLLM serves. Prefer ``from_pretrained(..., quantization_config=
    NVFP4Config())`` when starting from files: it never holds the 16-bit model at all.

    A mixture-of-experts model's routed experts (transformers' fused 3-D stacks, Qwen3-MoE's layout) become
    :class:`~qerl_trl.nvfp4.experts.NVFP4Experts`, one layer at a time, saved per expert as llm-compressor saves them
    for vLLM; their routers stay 16-bit (``ignore``: ``re:.*mlp.gate$``), as ``NVFP4Config`` packs them on load.
    """
    config = config or NVFP4Config()
    keep_fp32 = getattr(model, "_keep_in_fp32_modules", None)
    experts = fused_experts(model)
    check_expert_layout(model, experts)
    plan = beside_experts(model, experts, lambda: plan_conversion(
        model, config.modules_to_not_convert, config.fused_groups, keep_fp32=keep_fp32))
    moe = bool(experts)
    while experts:  # popped, so the layer's 16-bit experts are freed before the next layer is packed
        name, module = experts.popitem()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, NVFP4Experts.from_experts(module, name))
        del module
    done: set[str] = set()
    for name, group in plan.groups.items():
        if name in done:
            continue
        _quantize_group_in_place(model, group)
        done.update(group)
    plan.warn_unchosen()
    if getattr(model, "config", None) is not None:
        model.config.quantization_config = compressed_tensors_config([*plan.kept, *([ROUTER_IGNORE] if moe else [])])
    return plan


def _quantize_group_in_place(model: nn.Module, group: tuple[str, ...]) -> None:
    """Pack one fused group and swap its modules in; this frame holds the last references to the 16-bit ones."""
    linears = {n: model.get_submodule(n) for n in group}
    # conversion.quantize_group is looked up per call, as the loader's GroupQuantizer does (tests sample it)
    packed = conversion.quantize_group({n: m.weight.detach() for n, m in linears.items()})
    for n, m in linears.items():
        dtype = m.weight.dtype if m.weight.dtype in ACTIVATION_DTYPES else torch.bfloat16
        new = NVFP4Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta", dtype=dtype)
        new.load_quantized(packed.pop(n), bias=None if m.bias is None else m.bias.detach().to(dtype))
        parent, _, child = n.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
