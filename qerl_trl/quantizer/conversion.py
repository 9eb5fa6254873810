"""Module replacement and load-time quantization for ``NVFP4Config`` (no kernels, no transformers lifecycle).

The hard constraint is the *shared global scale*: vLLM fuses q/k/v (and gate/up) into one GEMM with one
global scale, so ``global = 448*6 / amax(q, k, v)`` needs all three tensors, while transformers streams the
checkpoint one tensor at a time. :class:`GroupQuantizer` holds the 16-bit members of a fused group only until
the group's last member arrives, then quantizes the whole group with the shared scale and frees them. The
checkpoint is read in sorted key order, so a group's members arrive within one decoder layer: at any moment at
most one group's 16-bit tensors (less than one layer) are alive beside the packed model.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from ..nvfp4 import NVFP4Linear
from ..nvfp4 import format as nvfp4
from .moe import refuse_moe_model

logger = logging.getLogger(__name__)

#: quantize at most this many weight elements at once (float32 temporaries of ~16 MiB each)
CHUNK_ELEMENTS = 1 << 22


def matches(name: str, patterns: Iterable[str] | None) -> bool:
    """Whether module ``name`` is named by any pattern: ``"re:<regex>"`` (full match, compressed-tensors style),
    the exact name, a dotted suffix (``"lm_head"``, ``"mlp.down_proj"``), or a parent (``"model.layers.0"``)."""
    for p in patterns or ():
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name):
                return True
        elif name == p or name.endswith("." + p) or name.startswith(p + "."):
            return True
    return False


def check_supported(model: nn.Module) -> None:
    """Refuse models whose bulk is not in ``nn.Linear`` (MoE expert tensors, or no Linear at all)."""
    refuse_moe_model(model)
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer to quantize to NVFP4.")


#: why a Linear stays 16-bit (``ConversionPlan.kept``); the first two are the user's or the format's choice
KEEP_USER = "named in modules_to_not_convert"
KEEP_OUTPUT_EMBEDDING = "output embedding (lm_head), 16-bit by design"
KEEP_CHECKPOINT = "stored 16-bit in the checkpoint"
KEEP_FP32 = "kept in fp32 by the model class (_keep_in_fp32_modules)"
KEEP_IN_FEATURES = f"in_features not a multiple of {nvfp4.BLOCK_SIZE} (the NVFP4 block size)"
#: the order reasons are reported in: what needs attention first
REASON_ORDER = (KEEP_IN_FEATURES, KEEP_FP32, KEEP_CHECKPOINT, KEEP_USER, KEEP_OUTPUT_EMBEDDING)
#: reasons that are a choice (the user's, the checkpoint author's, QeRL's format): not warned about
CHOSEN_REASONS = (KEEP_USER, KEEP_OUTPUT_EMBEDDING, KEEP_CHECKPOINT)


@dataclass
class ConversionPlan:
    """Which Linears become NVFP4 (each with its fused group) and which stay 16-bit."""

    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # module -> its group (incl. itself)
    kept: dict[str, str] = field(default_factory=dict)  # Linear left 16-bit -> why (the checkpoint's `ignore`)

    @property
    def modules(self) -> list[str]:
        return list(self.groups)

    def kept_by_reason(self, unchosen_only: bool = False) -> dict[str, list[str]]:
        """Kept modules grouped by reason; ``unchosen_only`` drops the user's, the checkpoint's and lm_head."""
        out: dict[str, list[str]] = {}
        for name, reason in self.kept.items():
            if not (unchosen_only and reason in CHOSEN_REASONS):
                out.setdefault(reason, []).append(name)
        return dict(sorted(out.items(), key=lambda kv: REASON_ORDER.index(kv[0])))

    def unchosen_lines(self) -> list[str]:
        """One line per reason a Linear stayed 16-bit that nobody chose: count, reason, first names."""
        total = len(self.kept) + len(self.groups)
        return [
            f"{len(names)} of {total} Linear layers stay 16-bit: {reason} ({_first(names)}). "
            "They train and serve unquantized."
            for reason, names in self.kept_by_reason(unchosen_only=True).items()
        ]

    def summary(self) -> str:
        """All Linears: how many are packed, and how many stay 16-bit for each reason."""
        kept = "; ".join(f"{len(v)} {k}" for k, v in self.kept_by_reason().items()) or "none"
        return f"{len(self.groups)} of {len(self.kept) + len(self.groups)} Linear layers in NVFP4; 16-bit: {kept}"

    def warn_unchosen(self) -> None:
        for line in self.unchosen_lines():
            logger.warning("NVFP4: %s", line)


def _first(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def keep_reason(
    name: str,
    in_features: int,
    *,
    output_embedding: bool,
    modules_to_not_convert: Iterable[str] | None,
    only: set[str] | None = None,
    keep_fp32: Iterable[str] | None = None,
) -> str | None:
    """Why Linear ``name`` stays 16-bit (one of the ``KEEP_*`` reasons), or None when it is quantized."""
    if output_embedding:
        return KEEP_OUTPUT_EMBEDDING
    if matches(name, modules_to_not_convert):
        return KEEP_USER
    if only is not None and name not in only:
        return KEEP_CHECKPOINT
    if matches(name, keep_fp32):
        return KEEP_FP32
    if in_features % nvfp4.BLOCK_SIZE:
        return KEEP_IN_FEATURES
    return None


def plan_conversion(
    model: nn.Module,
    modules_to_not_convert: Iterable[str] | None,
    fused_groups: Iterable[Iterable[str]],
    only: set[str] | None = None,
    keep_fp32: Iterable[str] | None = None,
) -> ConversionPlan:
    """Choose the Linears to quantize, and record why each other Linear stays 16-bit (``plan.kept``).

    Kept: the output embedding (``lm_head``), ``modules_to_not_convert``, the model class's
    ``_keep_in_fp32_modules`` (``keep_fp32``), Linears whose in_features is not a multiple of 16, and, for
    pre-quantized checkpoints, modules not in ``only`` (those stored packed). A fused group must be converted
    whole: a partly skipped q/k/v raises, since vLLM could not fuse it. Converting nothing raises.
    """
    check_supported(model)
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plan = ConversionPlan()
    converted: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        reason = keep_reason(
            name, module.in_features, output_embedding=module is out_emb,
            modules_to_not_convert=modules_to_not_convert, only=only, keep_fp32=keep_fp32,
        )  # fmt: skip
        if reason is None:
            converted.append(name)
        else:
            plan.kept[name] = reason
    if not converted:
        reasons = "; ".join(f"{len(v)} {k}" for k, v in plan.kept_by_reason().items())
        raise ValueError(
            f"NVFP4 found no Linear to quantize in {type(model).__name__}: all {len(plan.kept)} stay 16-bit "
            f"({reasons}). Check modules_to_not_convert, or use a model whose hidden sizes are multiples of "
            f"{nvfp4.BLOCK_SIZE}."
        )
    conv = set(converted)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for name in converted:
        parent, _, child = name.rpartition(".")
        prefix = parent + "." if parent else ""
        group: tuple[str, ...] = (name,)
        for spec in fused_groups:
            if child in spec:
                present = [prefix + c for c in spec if prefix + c in linears]
                missing = [n for n in present if n not in conv]
                if missing:
                    raise ValueError(
                        f"{name} is fused with {missing} in vLLM and they must be quantized together (one global "
                        f"scale): put all of {present} in modules_to_not_convert, or none of them."
                    )
                group = tuple(present)
                break
        plan.groups[name] = group
    return plan


def replace_linears(model: nn.Module, plan: ConversionPlan, dtype: torch.dtype, placeholder: bool) -> None:
    """Swap the planned ``nn.Linear`` modules (on the meta device) for empty ``NVFP4Linear`` modules.

    ``placeholder`` adds a meta ``weight`` parameter so transformers matches the 16-bit checkpoint tensor
    ``<module>.weight`` to the module and hands it to our quantize op; the op removes it once quantized.
    """
    for name in plan.groups:
        old = model.get_submodule(name)
        bias_dtype = old.bias.dtype if old.bias is not None and old.bias.is_floating_point() else dtype
        new = NVFP4Linear(old.in_features, old.out_features, bias=old.bias is not None, device="meta", dtype=bias_dtype)
        if placeholder:
            new.weight = nn.Parameter(
                torch.empty(old.out_features, old.in_features, dtype=dtype, device="meta"), requires_grad=False
            )
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)


def quantize_rows(weight: torch.Tensor, global_scale: torch.Tensor, name: str) -> nvfp4.NVFP4Weight:
    """``format.quantize`` in row chunks: identical output (rows are independent given the global scale), but
    float32 temporaries stay ~16 MiB instead of 4-8x the 16-bit tensor."""
    rows = max(1, CHUNK_ELEMENTS // max(1, weight.shape[1]))
    if weight.shape[0] <= rows:
        return nvfp4.quantize(weight, global_scale=global_scale, name=name)
    parts = [nvfp4.quantize(weight[i : i + rows], global_scale=global_scale, name=name) for i in range(0, weight.shape[0], rows)]
    return nvfp4.NVFP4Weight(
        torch.cat([p.weight_packed for p in parts]),
        torch.cat([p.weight_scale for p in parts]),
        parts[0].weight_global_scale,
    )


def quantize_group(weights: dict[str, torch.Tensor]) -> dict[str, nvfp4.NVFP4Weight]:
    """Quantize the members of one fused group with their shared global scale (consumes ``weights``)."""
    for name, w in weights.items():
        nvfp4.check_finite(w, name + ".weight")
    gs = nvfp4.compute_global_scale(*weights.values())
    out = {}
    for name in list(weights):
        out[name] = quantize_rows(weights.pop(name), gs, name + ".weight")
    return out


class GroupQuantizer:
    """Buffers fused-group members as they stream in; quantizes a group when its last member arrives."""

    def __init__(self, plan: ConversionPlan) -> None:
        self.plan = plan
        self.pending: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
        #: high-water mark of 16-bit bytes buffered here (for tests and logs)
        self.max_pending_bytes = 0

    def add(self, name: str, weight: torch.Tensor) -> dict[str, nvfp4.NVFP4Weight]:
        group = self.plan.groups[name]
        bucket = self.pending.setdefault(group, {})
        if name in bucket:
            raise ValueError(f"the checkpoint holds {name}.weight twice")
        bucket[name] = weight
        held = sum(t.numel() * t.element_size() for b in self.pending.values() for t in b.values())
        self.max_pending_bytes = max(self.max_pending_bytes, held)
        if len(bucket) < len(group):
            return {}
        del self.pending[group]
        return quantize_group(bucket)

    def unfinished(self) -> dict[tuple[str, ...], list[str]]:
        """Groups some of whose members never arrived: group -> missing member names."""
        return {g: [n for n in g if n not in b] for g, b in self.pending.items()}


def freeze_nvfp4(model: nn.Module) -> None:
    """Loaders wrap tensors as ``requires_grad=is_floating_point()``; the NVFP4 base is frozen by design."""
    for m in model.modules():
        if isinstance(m, NVFP4Linear):
            for p in m.parameters(recurse=False):
                p.requires_grad_(False)
