"""vLLM quantization method ``qerl_nvfp4_lora``: compressed-tensors NVFP4A16 with the policy's one LoRA built into
each linear layer. Written against vLLM 0.24.0 (``CompressedTensorsConfig``, ``LinearMethodBase``, the linear layer
classes' ``tp_rank`` / ``num_kv_head_replicas`` attributes).

Why: an RL run serves exactly one adapter that changes every step. vLLM's multi-LoRA machinery (punica kernels,
index mappings, adapter files, ``LoRARequest``) cost 52% of NVFP4 decode at 7B batch 1 on an H100
(``benchmarks/results/rollout-h100.json``) for generality this job does not use. Here each targeted linear layer
holds the LoRA as two buffers, ``qerl_lora_a`` ``[S*r, in_local]`` and ``qerl_lora_b`` ``[out_local, S*r]``
(layout: :mod:`.lora_shards`), and its forward is the NVFP4 kernel's output plus the LoRA delta: at decode sizes a
Triton shrink before the NVFP4 GEMM and a Triton expand that adds into its output in place; two GEMMs above
(:mod:`.lora_kernels`). The trainer copies each step's A and B into the
buffers in place (:func:`push_lora_in_place`), so CUDA graphs and torch.compile see the new adapter with nothing
re-captured.

The base GEMM is vLLM's compressed-tensors NVFP4A16 method (Marlin on Hopper) or, with ``"fp4_kernel": "humming"``
in the spec, vLLM's Humming method on every linear whose shape Humming takes (:class:`FP4KernelByShape`; the rest
stay on Marlin). Humming reads the same checkpoint tensors.

The engine is asked for it with ``LLM(..., quantization="qerl_nvfp4_lora", hf_overrides={"quantization_config":
<the checkpoint's compressed-tensors config + {"qerl_lora": {"rank": r, "target_modules": [...], "fp4_kernel": k}}>})``
(``qerl_trl.vllm_plugin.quant_spec.lora_quantization_overrides``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.linear import (
    WEIGHT_LOADER_V2_SUPPORTED,
    ColumnParallelLinear,
    LinearBase,
    LinearMethodBase,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

from .fp4_kernel import humming_shape_problem
from .humming_ahead import HummingAhead, engine_row_budget
from .humming_tail import expand_in_gemm_problem, lora_tail_meta, tail_width, widen_for_lora_tail, write_lora_tail
from .quant_spec import LORA_KEY, OTHER_BACKEND_HINT, QUANT_NAME
from .lora_kernels import lora_expand_, lora_partials, lora_shrink, lora_shrink_concat, lora_slot_bounds
from .lora_shards import LoRAShardPlan, column_parallel_plan, fill_lora_buffers, row_parallel_plan

__all__ = [
    "QUANT_NAME",
    "LORA_KEY",
    "ExpandInGemmLoRALinearMethod",
    "FP4KernelByShape",
    "SingleLoRALinearMethod",
    "fp4_kernels_of",
    "QeRLNVFP4LoRAConfig",
    "push_lora_in_place",
    "layer_lora_plan",
]


def layer_lora_plan(
    layer: nn.Module, names: list[str], output_partition_sizes: list[int], input_size_per_partition: int, rank: int
) -> LoRAShardPlan:
    """This rank's LoRA layout for a vLLM linear layer packing ``names`` (called from ``create_weights``)."""
    if isinstance(layer, RowParallelLinear):
        if len(names) != 1:
            raise ValueError(f"A row-parallel layer holds one linear, got {names}.")
        return row_parallel_plan(names[0], sum(output_partition_sizes), input_size_per_partition, layer.tp_rank, rank)
    if len(names) != len(output_partition_sizes):
        raise ValueError(
            f"{type(layer).__name__} packs {len(output_partition_sizes)} linears but the LoRA names are {names}: "
            f"the model class declares no packed_modules_mapping for it, which the single-LoRA path needs. "
            f"{OTHER_BACKEND_HINT}"
        )
    if isinstance(layer, QKVParallelLinear):
        kv_shard = layer.tp_rank // layer.num_kv_head_replicas
        shards = [layer.tp_rank, kv_shard, kv_shard]
    elif isinstance(layer, ColumnParallelLinear):  # also MergedColumnParallelLinear: every output split evenly
        shards = [layer.tp_rank] * len(names)
    elif isinstance(layer, ReplicatedLinear):
        shards = [0] * len(names)
    else:
        raise TypeError(f"The single-LoRA path does not know how {type(layer).__name__} is sharded. {OTHER_BACKEND_HINT}")
    return column_parallel_plan(names, output_partition_sizes, input_size_per_partition, rank, shards)


def _inner_weight_loader(layer: nn.Module, inner: LinearMethodBase) -> Callable:
    """The weight loader vLLM would have given ``inner``'s parameters: the layer chose its loader by the *wrapper's*
    class name (vLLM's ``WEIGHT_LOADER_V2_SUPPORTED``), which names neither of ours."""
    v2 = type(inner).__name__ in WEIGHT_LOADER_V2_SUPPORTED
    return getattr(layer, "weight_loader_v2", layer.weight_loader) if v2 else layer.weight_loader


def _is_nvfp4a16(layer: nn.Module, method: LinearMethodBase) -> bool:
    """Whether compressed-tensors gave ``layer`` its NVFP4 weight-only scheme (what Humming can take instead)."""
    scheme = getattr(layer, "scheme", None)
    return (type(method).__name__ == "CompressedTensorsLinearMethod"
            and type(scheme).__name__ == "CompressedTensorsW4A4Fp4" and bool(getattr(scheme, "use_a16", False)))


class FP4KernelByShape(LinearMethodBase):
    """One linear's NVFP4A16 base GEMM: Humming where the layer's per-shard shape fits it, else ``marlin`` (vLLM's
    compressed-tensors method). The shape is known only in ``create_weights``, so the choice is made there; the
    layer's ``qerl_fp4_kernel`` records it (``"humming"`` or ``"marlin: <why>"``)."""

    def __init__(self, marlin: LinearMethodBase, humming: Callable[[], LinearMethodBase],
                 ahead: HummingAhead | None = None):  # fmt: skip
        self.marlin = marlin
        self.make_humming = humming
        self.chosen: LinearMethodBase = marlin
        self.ahead = ahead  # Humming's kernels compiled ahead, on the engine's table (spec "humming_ahead")
        self.tuning_config: str | None = None  # the engine's table the forward passes Humming, once planned

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        problem = humming_shape_problem(output_partition_sizes, input_size_per_partition)
        if problem is None:
            self.chosen = self.make_humming()
            if hasattr(layer, "scheme"):  # compressed-tensors' scheme (Marlin) no longer runs this layer
                del layer.scheme
            layer.qerl_fp4_kernel = "humming"
        else:
            layer.qerl_fp4_kernel = f"marlin: {problem}"
        extra_weight_attrs["weight_loader"] = _inner_weight_loader(layer, self.chosen)
        self.chosen.create_weights(
            layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype,
            **extra_weight_attrs,
        )  # fmt: skip

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.chosen.process_weights_after_loading(layer)
        compute_config = getattr(self.chosen, "compute_config", None)  # vLLM's Humming method's, unless it fell back
        if self.ahead is not None and self.chosen is not self.marlin and compute_config is not None:
            self.tuning_config = self.ahead.plan(layer, compute_config)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.tuning_config is not None:
            return HummingAhead.apply(layer, x, self.chosen.compute_config, self.tuning_config)
        return self.chosen.apply(layer, x, bias)


class SingleLoRALinearMethod(LinearMethodBase):
    """Any vLLM linear method (here the compressed-tensors NVFP4A16 one) plus one LoRA: ``inner(x) + x A^T B^T``."""

    def __init__(self, inner: LinearMethodBase, names: list[str], rank: int):
        self.inner = inner
        self.names = list(names)
        self.rank = int(rank)

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        extra_weight_attrs["weight_loader"] = _inner_weight_loader(layer, self.inner)
        self.inner.create_weights(
            layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype,
            **extra_weight_attrs,
        )  # fmt: skip
        plan = layer_lora_plan(layer, self.names, output_partition_sizes, input_size_per_partition, self.rank)
        (_, ca), (rb, cb) = plan.buffer_shapes()
        layer.qerl_lora_plan = plan
        rows = self.shrink_rows(layer, plan)
        # Buffers, not parameters: the checkpoint has no such tensors and vLLM's loaders must not look for them.
        # Allocated here, inside the loader's device context and the "weights" memory pool (sleep level 1 keeps them).
        layer.register_buffer("qerl_lora_a", torch.zeros(rows, ca, dtype=params_dtype), persistent=False)
        layer.register_buffer("qerl_lora_b", torch.zeros(rb, cb, dtype=params_dtype), persistent=False)
        starts = [s.out_start for s in plan.slots]
        layer.register_buffer("qerl_lora_bounds", lora_slot_bounds(starts, plan.out_rows, rows), persistent=False)
        layer.register_buffer("qerl_lora_partials", lora_partials(rows), persistent=False)

    def shrink_rows(self, layer: nn.Module, plan: LoRAShardPlan) -> int:
        """The rows of the layer's A buffer and of the shrink's scratch: the plan's ``S*r`` (the first ``S*r`` rows
        of A are the slots', any further rows stay zero)."""
        return plan.total_rank

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        plan = layer.qerl_lora_plan
        shrunk = lora_shrink(x, layer.qerl_lora_a, layer.qerl_lora_bounds, layer.qerl_lora_partials, self.rank,
                             plan.out_rows)  # fmt: skip
        y = self.inner.apply(layer, x, bias)
        lora_expand_(y, shrunk, layer.qerl_lora_b, layer.qerl_lora_bounds, layer.qerl_lora_partials, self.rank,
                     plan.in_cols)  # fmt: skip
        return y


class ExpandInGemmLoRALinearMethod(SingleLoRALinearMethod):
    """:class:`SingleLoRALinearMethod` whose expand runs inside Humming's GEMM (spec ``"expand_in_gemm"``): the
    layer's NVFP4 weight gets ``S*r`` extra input columns holding ``B`` (:mod:`.humming_tail`), and its input is
    ``[x | x A^T]`` from one launch (:func:`lora_shrink_concat`). One launch per linear instead of two, and no
    read-modify-write of the output; ``B`` runs in NVFP4. A layer that cannot take it (Marlin, or a width
    :func:`expand_in_gemm_problem` refuses) runs the two-launch pair; ``qerl_expand_in_gemm`` says which, and why."""

    def shrink_rows(self, layer: nn.Module, plan: LoRAShardPlan) -> int:
        """Decide here, with the FP4 kernel chosen and before the buffers exist, whether the layer takes the expand
        inside its GEMM; if so, A gets the tail's width (``S*r`` rounded up to 16): its zero rows make the pad
        columns of ``[x | x A^T]`` zero."""
        problem = expand_in_gemm_problem(getattr(layer, "qerl_fp4_kernel", type(self.inner).__name__), plan.in_cols)
        layer.qerl_expand_in_gemm = problem is None
        layer.qerl_expand_in_gemm_why = problem
        return plan.total_rank if problem else tail_width(plan.total_rank)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.qerl_expand_in_gemm:
            return super().process_weights_after_loading(layer)
        width = tail_width(layer.qerl_lora_plan.total_rank)
        in_features = widen_for_lora_tail(layer, width)
        layer.input_size_per_partition = in_features + width  # what Humming reads
        try:
            self.inner.process_weights_after_loading(layer)
        finally:
            layer.input_size_per_partition = in_features
        layer.qerl_tail_meta = lora_tail_meta(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not layer.qerl_expand_in_gemm:
            return super().apply(layer, x, bias)
        xs = lora_shrink_concat(x, layer.qerl_lora_a, layer.qerl_lora_bounds, layer.qerl_lora_partials,
                                len(layer.qerl_lora_plan.slots))  # fmt: skip
        return self.inner.apply(layer, xs.view(*x.shape[:-1], xs.shape[-1]), bias)


@register_quantization_config(QUANT_NAME)
class QeRLNVFP4LoRAConfig(CompressedTensorsConfig):
    """compressed-tensors (NVFP4A16) checkpoints, with :class:`SingleLoRALinearMethod` on the LoRA's linears and,
    with ``fp4_kernel="humming"``, Humming as the base GEMM of every linear it fits (:class:`FP4KernelByShape`)."""

    lora_rank: int
    lora_targets: frozenset[str]
    fp4_kernel: str = "marlin"
    wants_humming_ahead: bool = False  # spec "humming_ahead" (see .humming_ahead)
    expand_in_gemm: bool = False  # spec "expand_in_gemm" (see .humming_tail)
    humming_ahead: HummingAhead | None = None  # one per engine, made with its first layer on Humming
    quant_config_dict: dict[str, Any]

    def get_name(self) -> str:  # type: ignore[override]
        return QUANT_NAME

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QeRLNVFP4LoRAConfig:
        config = dict(config)
        spec = config.pop(LORA_KEY, None)
        if not isinstance(spec, Mapping) or "rank" not in spec or not spec.get("target_modules"):
            raise ValueError(
                f"quantization={QUANT_NAME!r} needs quantization_config[{LORA_KEY!r}] = {{'rank': r, "
                "'target_modules': [...]}}; build the engine's overrides with lora_quantization_overrides()."
            )
        kernel = spec.get("fp4_kernel", "marlin")
        if kernel not in ("humming", "marlin"):
            raise ValueError(f"quantization_config[{LORA_KEY!r}]['fp4_kernel'] must be 'humming' or 'marlin', got "
                             f"{kernel!r}.")  # fmt: skip
        self = super().from_config(config)
        self.lora_rank = int(spec["rank"])
        self.lora_targets = frozenset(spec["target_modules"])
        self.fp4_kernel = kernel
        self.wants_humming_ahead = bool(spec.get("humming_ahead", False))
        self.expand_in_gemm = bool(spec.get("expand_in_gemm", False))
        self.quant_config_dict = config  # Humming reads the checkpoint's compressed-tensors config itself
        return self

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        super().apply_vllm_mapper(hf_to_vllm_mapper)
        self._vllm_mapper = hf_to_vllm_mapper

    def humming_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        """vLLM's own Humming linear method for ``layer``, as ``quantization="humming"`` would build it from this
        checkpoint (vLLM 0.24 ``HummingConfig``)."""
        from vllm.model_executor.layers.quantization.humming import HummingConfig

        humming = HummingConfig(full_config=self.quant_config_dict)
        if getattr(self, "_vllm_mapper", None) is not None:
            humming.apply_vllm_mapper(self._vllm_mapper)
        return humming.get_quant_method(layer, prefix)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None):
        if user_quant == QUANT_NAME and hf_quant_cfg.get("quant_method") == "compressed-tensors":
            return QUANT_NAME
        return None

    def lora_names(self, prefix: str) -> list[str]:
        """The linears a layer packs, if the LoRA targets any of them (else [])."""
        last = prefix.rsplit(".", 1)[-1]
        names = list(self.packed_modules_mapping.get(last, [last]))
        return names if any(n in self.lora_targets for n in names) else []

    def get_quant_method(self, layer: nn.Module, prefix: str):
        method = super().get_quant_method(layer, prefix)
        if isinstance(layer, LinearBase) and isinstance(method, LinearMethodBase):
            if self.fp4_kernel == "humming" and _is_nvfp4a16(layer, method):
                if self.wants_humming_ahead and self.humming_ahead is None:  # vLLM's config is current while it builds
                    self.humming_ahead = HummingAhead(*engine_row_budget())
                method = FP4KernelByShape(method, lambda: self.humming_method(layer, prefix),
                                          self.humming_ahead if self.wants_humming_ahead else None)  # fmt: skip
            names = self.lora_names(prefix)
            if names:
                cls = ExpandInGemmLoRALinearMethod if self.expand_in_gemm else SingleLoRALinearMethod
                return cls(method, names, self.lora_rank)
        return method


def fp4_kernels_of(model: nn.Module) -> dict[str, str]:
    """``{linear layer: its FP4 kernel}`` in a vLLM model: ``"humming"`` (``"humming+expand"`` where the LoRA's expand
    runs inside its GEMM: ``vllm_lora_expand_in_gemm``), ``"marlin: ..."`` (the Marlin kernel
    class, or why the layer is not on Humming) or another method's class name; unquantized linears are left out. For
    checks and the trainer's log, on either LoRA backend (vLLM's LoRA wrappers hold the layer as ``base_layer``)."""
    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(module, LinearBase) or method is None:
            continue
        while isinstance(method, SingleLoRALinearMethod):
            method = method.inner
        if isinstance(method, FP4KernelByShape):
            method = method.chosen
        kind = type(method).__name__
        if kind == "UnquantizedLinearMethod":
            continue
        if kind == "HummingLinearMethod":
            out[name] = "humming+expand" if getattr(module, "qerl_expand_in_gemm", False) else "humming"
        elif kind == "CompressedTensorsLinearMethod":
            kernel = type(getattr(getattr(module, "scheme", None), "kernel", None)).__name__
            reason = getattr(module, "qerl_fp4_kernel", "")
            out[name] = f"marlin: {kernel}" + (f" ({reason.removeprefix('marlin: ')})" if reason else "")
        else:
            out[name] = kind
    return out


def push_lora_in_place(model: nn.Module, adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> int:
    """Copy the trainer's LoRA into every single-LoRA layer of vLLM's ``model`` (run inside the engine, e.g. through
    ``LLM.apply_model``). ``adapters``: full ``(A [r, in], B [out, r])`` keyed by the module's name in vLLM's tree
    (``model.layers.0.self_attn.q_proj``). Every adapter must land somewhere, and a layer's sub-modules missing from
    ``adapters`` get zeros (``{}`` serves the bare base). Returns the number of single-LoRA layers written."""
    used: set[str] = set()
    layers = 0
    saturated = []
    for prefix, module in model.named_modules():
        plan = getattr(module, "qerl_lora_plan", None)
        if plan is None:
            continue
        parent = prefix.rpartition(".")[0]
        mine = {s.name: adapters[f"{parent}.{s.name}"] for s in plan.slots if f"{parent}.{s.name}" in adapters}
        device = module.qerl_lora_a.device
        mine = {k: (a.to(device, non_blocking=True), b.to(device, non_blocking=True)) for k, (a, b) in mine.items()}
        # the first S*r rows of A: an expand-in-GEMM layer's A has zero rows after them (tail_width)
        fill_lora_buffers(plan, module.qerl_lora_a[: plan.total_rank], module.qerl_lora_b, mine, scaling)
        if getattr(module, "qerl_expand_in_gemm", False):
            saturated.append(write_lora_tail(module))
        used.update(f"{parent}.{n}" for n in mine)
        layers += 1
    if saturated and bool(torch.stack(saturated).any()):  # one host sync a push
        warnings.warn("vllm_lora_expand_in_gemm: some of the LoRA's B outgrew the NVFP4 range of its layer's base "
                      "weight and was clipped in vLLM; set vllm_lora_expand_in_gemm=False.", stacklevel=2)  # fmt: skip
    missing = sorted(set(adapters) - used)
    if missing:
        raise KeyError(
            f"{len(missing)} LoRA modules have no single-LoRA layer in vLLM's model, e.g. {missing[:3]}: the engine "
            "was built for other target modules, or they are not linear layers vLLM quantizes (embeddings, the LM "
            f"head). {OTHER_BACKEND_HINT}"
        )
    return layers
