"""``NVFP4HfQuantizer``: the transformers lifecycle for ``NVFP4Config`` (what happens when, during from_pretrained).

* before weights load: swap the planned ``nn.Linear`` modules (meta) for ``NVFP4Linear``;
* 16-bit checkpoint: each ``<linear>.weight`` streams through :class:`NVFP4Quantize` (transformers loads
  on-the-fly-quantized checkpoints one tensor at a time, synchronously), which quantizes a fused group as soon as
  its last member arrives (see ``conversion.GroupQuantizer``);
* NVFP4A16 checkpoint (``pre_quantized``): the packed tensors load as they are;
* a mixture-of-experts model (transformers' fused 3-D expert stacks, Qwen3-MoE's layout) from a 16-bit checkpoint:
  each layer's stack arrives merged from the per-expert tensors and is packed into an ``NVFP4Experts`` there, one
  layer at a time; from an NVFP4A16 checkpoint, its per-expert packed tensors are stacked by the loader's weight
  conversion (``update_weight_conversions``) into an ``NVFP4ExpertsCheckpoint``, then taken as ``NVFP4Experts``;
* after loading: freeze the NVFP4 tensors and make ``model.config.quantization_config`` the compressed-tensors
  NVFP4A16 dict, so ``save_pretrained`` writes a checkpoint vLLM serves directly.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer

from ..nvfp4 import NVFP4Linear
from ..nvfp4.experts import NVFP4Experts, NVFP4ExpertsCheckpoint
from . import compat
from .checkpoint import compressed_tensors_config, packed_modules
from .config import NVFP4Config
from .conversion import (
    ConversionPlan,
    GroupQuantizer,
    freeze_nvfp4,
    matches,
    plan_conversion,
    replace_linears,
)
from .moe import ROUTER_IGNORE, beside_experts, check_expert_layout, fused_experts

logger = logging.getLogger(__name__)

#: bytes per quantized weight element: 4-bit code + one FP8 scale per 16 (the global scale is negligible)
NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16


class NVFP4Quantize(ConversionOps):
    """Quantize-on-load op: receives ``{"<linear>.weight": [tensor]}``, returns the NVFP4 tensors of every member
    of the fused group once the group is complete (an empty dict until then)."""

    def __init__(self, hf_quantizer: "NVFP4HfQuantizer") -> None:
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], source_patterns=None, target_patterns=None, **kwargs):
        hq = self.hf_quantizer
        model = kwargs.get("model")
        missing_keys = kwargs.get("missing_keys")
        out: dict[str, torch.Tensor] = {}
        for key, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            if key.rpartition(".")[0] in hq.experts:
                hq.pack_experts(model, key, tensor, missing_keys)
                continue
            name = key[: -len(".weight")]
            try:
                quantized = hq.group_quantizer.add(name, tensor)
            except Exception as e:  # transformers only logs conversion errors; we re-raise after loading
                hq.errors.append(e)
                raise
            for member, q in quantized.items():
                module = model.get_submodule(member) if model is not None else None
                if module is not None:  # the placeholder has done its job: the checkpoint tensor was routed here
                    module._parameters.pop("weight", None)
                if missing_keys is not None:
                    missing_keys.discard(member + ".weight")
                for attr, t in q._asdict().items():
                    out[f"{member}.{attr}"] = nn.Parameter(t, requires_grad=False)
            del tensor
        return out


class RecordStack(ConversionOps):
    """The last op of an NVFP4A16 MoE checkpoint's expert merges: records each stack's shape as it arrives. transformers
    initializes a parameter the checkpoint lacks (or gave with another shape) and only logs it; the quantizer refuses
    the load after it instead, since random experts would train and serve silently."""

    def __init__(self, hf_quantizer: "NVFP4HfQuantizer") -> None:
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo: dict) -> "RecordStack":
        return self  # transformers copies a converter per target; the records must reach this quantizer

    def convert(self, input_dict: dict[str, Any], source_patterns=None, target_patterns=None, **kwargs):
        for value in input_dict.values():
            tensor = value[0] if isinstance(value, list) else value
            self.hf_quantizer.loaded_stacks[kwargs.get("full_layer_name")] = tuple(tensor.shape)
        return input_dict


class NVFP4HfQuantizer(compat.HfQuantizerCompat, HfQuantizer):
    """Lifecycle of :class:`NVFP4Config` inside ``PreTrainedModel.from_pretrained``."""

    requires_calibration = False
    quantization_config: NVFP4Config

    def __init__(self, quantization_config: NVFP4Config, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.plan: ConversionPlan | None = None
        self.group_quantizer: GroupQuantizer | None = None
        self.dtype: torch.dtype = torch.bfloat16
        #: errors raised while quantizing on load (transformers turns them into a log line and carries on)
        self.errors: list[Exception] = []
        #: the model's fused expert stacks (``fused_experts``), and the (module, parameter) of each already packed
        self.experts: set[str] = set()
        self.packed_experts: set[tuple[str, str]] = set()
        #: NVFP4A16 MoE checkpoint: ``{stacked parameter: its shape}`` as the loader merged it (``RecordStack``)
        self.loaded_stacks: dict[str, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ before loading
    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        device_map = kwargs.get("device_map")
        if not self.pre_quantized and isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError(
                "NVFP4Config cannot quantize on load into disk-offloaded modules; use a device_map without 'disk'."
            )

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        if dtype is None:
            logger.info("NVFP4Config: loading the unquantized parts in bfloat16 (pass dtype=... to change)")
            return torch.bfloat16
        return dtype

    def preprocess_model(self, model, dtype=None, **kwargs):
        self.dtype = dtype or self.dtype  # transformers passes dtype here but not to the hook below
        return super().preprocess_model(model, dtype=dtype, **kwargs)

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        cfg = self.quantization_config
        only = None
        skip = list(cfg.modules_to_not_convert or [])
        if self.pre_quantized:
            only = packed_modules(checkpoint_files)
            if only is None:  # no safetensors headers to read: trust the checkpoint's ignore list
                only = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
                only -= {n for n in only if matches(n, cfg.checkpoint_ignore)}
            else:
                only = {n for n, _ in model.named_modules() if n in only or any(k.endswith("." + n) for k in only)}
        keep_fp32 = getattr(model, "_keep_in_fp32_modules", None)
        experts = fused_experts(model)
        check_expert_layout(model, experts)
        self.experts = set(experts)
        self.plan = beside_experts(model, experts, lambda: plan_conversion(
            model, skip, cfg.fused_groups, only=only, keep_fp32=keep_fp32))
        if self.pre_quantized:  # the per-expert packed tensors land here, stacked (see update_weight_conversions)
            for name, module in experts.items():
                two_width, hidden = module.gate_up_proj.shape[1:]
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child,
                        NVFP4ExpertsCheckpoint(module.gate_up_proj.shape[0], hidden, two_width // 2, module.act_fn))
        self.group_quantizer = GroupQuantizer(self.plan)
        replace_linears(model, self.plan, self.dtype, placeholder=not self.pre_quantized)
        kept = list(self.plan.kept)
        logger.info(
            "NVFP4: %d Linear layers %s, %d kept 16-bit (%s)",
            len(self.plan.groups), "loaded packed" if self.pre_quantized else "quantized on load",
            len(kept), ", ".join(kept[:4]) + (" ..." if len(kept) > 4 else ""),
        )
        self.plan.warn_unchosen()
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs: Any) -> bool:
        if self.pre_quantized or self.plan is None:
            return False
        module_name, _, tensor_name = param_name.rpartition(".")
        if module_name in self.experts:
            return tensor_name in ("gate_up_proj", "down_proj")
        return tensor_name == "weight" and module_name in self.plan.groups

    def update_weight_conversions(self, weight_conversions, *args, **kwargs):
        """An NVFP4A16 MoE checkpoint: the model's own conversion of per-expert 16-bit weights into its fused stacks
        (``mlp.experts.*.gate_proj.weight`` -> ``mlp.experts.gate_up_proj``) is replaced by the same merge of the
        packed tensors into :class:`NVFP4ExpertsCheckpoint`. transformers' ``HfQuantizer`` hook: 5.17 passes the
        conversions, later versions also the model (passed on)."""
        weight_conversions = super().update_weight_conversions(weight_conversions, *args, **kwargs)
        if not (self.pre_quantized and self.experts):
            return weight_conversions
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

        fused = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
        def targets(w) -> list[str]:  # 5.17 keeps them as given; later versions also as _original_target_patterns
            found = getattr(w, "_original_target_patterns", None) or getattr(w, "target_patterns", None) or ()
            return [found] if isinstance(found, str) else list(found)

        kept = [w for w in weight_conversions if not any(t in fused for t in targets(w))]
        ours = []
        suffixes = (("weight_packed", "packed"), ("weight_scale", "scale"), ("weight_global_scale", "global_scale"))
        for key, suffix in suffixes:
            ours.append(WeightConverter([f"mlp.experts.*.gate_proj.{key}", f"mlp.experts.*.up_proj.{key}"],
                                        f"mlp.experts.gate_up_{suffix}",
                                        [MergeModulelist(dim=0), Concatenate(dim=1), RecordStack(self)]))
            ours.append(WeightConverter(f"mlp.experts.*.down_proj.{key}", f"mlp.experts.down_{suffix}",
                                        [MergeModulelist(dim=0), RecordStack(self)]))  # fmt: skip
        return kept + ours

    def pack_experts(self, model, key: str, stack: torch.Tensor, missing_keys: set[str] | None) -> None:
        """One layer's merged expert stack (``<experts>.gate_up_proj`` or ``.down_proj``, 16-bit, [experts, out,
        in]) packed into that layer's ``NVFP4Experts``, which replaces transformers' module when the first of its two
        stacks arrives; the 16-bit stack is dropped at once."""
        name, _, param = key.rpartition(".")
        module = model.get_submodule(name)
        if not isinstance(module, NVFP4Experts):
            experts, rows, cols = stack.shape
            hidden, width = (cols, rows // 2) if param == "gate_up_proj" else (rows, cols)
            packed = NVFP4Experts(experts, hidden, width, module.act_fn, device=stack.device)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, packed)
            module = packed
        module.load_stack("gate_up" if param == "gate_up_proj" else "down", stack, name)
        self.packed_experts.add((name, param))
        if missing_keys is not None:
            missing_keys.discard(key)

    def param_element_size(self, model, param_name: str, param: torch.Tensor) -> float:
        if self.param_needs_quantization(model, param_name):
            return NVFP4_BYTES_PER_WEIGHT
        return param.element_size()

    def get_quantize_ops(self) -> NVFP4Quantize:
        return NVFP4Quantize(self)

    # ------------------------------------------------------------------ after loading
    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.errors:
            raise self.errors[0]
        unfinished = self.group_quantizer.unfinished() if self.group_quantizer else {}
        if unfinished:
            group, missing = next(iter(unfinished.items()))
            raise ValueError(
                f"the checkpoint lacks {[m + '.weight' for m in missing]}, so the fused group {list(group)} could "
                "not get its shared NVFP4 global scale. Is the checkpoint complete?"
            )
        #: most 16-bit bytes the fused-group buffer held at once during this load (tests/logs)
        self.max_pending_bytes = self.group_quantizer.max_pending_bytes if self.group_quantizer else 0
        self.group_quantizer = None
        # the placeholders of quantize-on-load, and the stacks an NVFP4A16 MoE checkpoint loaded into, all filled
        for name in [*self.plan.groups, *(self.experts if self.pre_quantized else ())]:
            module = model.get_submodule(name)
            module._parameters.pop("weight", None)
            meta = [n for n, p in module.named_parameters() if p.device.type == "meta"]
            if meta:
                raise ValueError(f"NVFP4: {name} was not loaded ({meta} missing from the checkpoint)")
        if self.pre_quantized:
            for name in self.experts:
                expected = model.get_submodule(name).expected
                wrong = [f"{name}.{n}" for n, (shape, _) in expected.items()
                         if self.loaded_stacks.get(f"{name}.{n}") != shape]  # fmt: skip
                if wrong:
                    raise ValueError(f"NVFP4: the checkpoint's experts for {wrong[:3]} are missing or incomplete (some "
                                     "experts' tensors absent). Is the checkpoint complete?")  # fmt: skip
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, model.get_submodule(name).to_experts(name))
        else:
            unpacked = sorted(f"{m}.{p}" for m in self.experts for p in ("gate_up_proj", "down_proj")
                              if (m, p) not in self.packed_experts)  # fmt: skip
            if unpacked:
                raise ValueError(f"NVFP4: the checkpoint did not give {unpacked[:3]} (expert stacks), so they were "
                                 "not packed. Is the checkpoint complete?")  # fmt: skip
        freeze_nvfp4(model)
        if self.pre_quantized:
            self._warn_unshared_scales(model)
        model.config.quantization_config = compressed_tensors_config(
            [*self.plan.kept, *([ROUTER_IGNORE] if self.experts else [])])
        return model

    def _warn_unshared_scales(self, model) -> None:
        seen = set()
        for group in self.plan.groups.values():
            if len(group) < 2 or group in seen:
                continue
            seen.add(group)
            scales = {model.get_submodule(n).weight_global_scale.item() for n in group}
            if len(scales) > 1:
                logger.warning("NVFP4: %s have different global scales; vLLM fuses them with one.", list(group))

    def _dequantize(self, model, dtype=None):
        """Replace every NVFP4Linear by an nn.Linear holding its dequantized weight (lossless w.r.t. Ŵ)."""
        dtype = dtype or self.dtype
        for name, module in list(model.named_modules()):
            if isinstance(module, NVFP4Linear):
                lin = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                device=module.weight_packed.device, dtype=dtype)
                with torch.no_grad():
                    lin.weight.copy_(module.dequantize(dtype))
                    if module.bias is not None:
                        lin.bias.copy_(module.bias)
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, lin)
        return model

    # ------------------------------------------------------------------ capabilities
    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        # adapters (PEFT LoRA) on top of the frozen NVFP4 base
        return True

    @property
    def is_qat_trainable(self) -> bool:
        # the packed base itself has no gradients: training needs an adapter
        return False

    @property
    def is_compileable(self) -> bool:
        return False
