"""``vllm_lora_backend="qerl"``: the policy's LoRA built into each linear of QeRL's vLLM quantization method
``qerl_nvfp4_lora`` (:mod:`qerl_trl.vllm_plugin`).

``enable_lora`` stays off; the engine is told the LoRA's rank and targets through ``hf_overrides``, and each sync
copies A and B (scaling folded in) into the layers in place through ``LLM.apply_model``, so CUDA graphs and compiled
graphs see the new LoRA with no adapter files.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from torch import nn

from .lora_backend import GatherParams, VLLMLoRABackend
from .peft_tensors import lora_target_leaves, peft_lora_modules

__all__ = ["InLayerLoRABackend", "single_lora_engine_kwargs"]

logger = logging.getLogger(__name__)


def single_lora_engine_kwargs(checkpoint: str, model: nn.Module, fp4_kernel: str = "marlin",
                              humming_ahead: bool = False, expand_in_gemm: bool = False) -> dict[str, Any]:  # fmt: skip
    """``LLM(...)`` arguments for lora_backend="qerl": our quantization method (registered here too, in case vLLM's
    plugin entry point is not installed), told the LoRA's rank, target modules, FP4 kernel, whether Humming
    compiles ahead and whether the LoRA's expand runs inside Humming's GEMM, through ``hf_overrides``."""
    from ...vllm_plugin import QUANT_NAME, lora_quantization_overrides, register

    register(strict=True)
    rank = int(model.peft_config["default"].r)  # not the tensors' shapes: ZeRO-3 shards them to size 0 here
    targets = lora_target_leaves(model)
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    overrides = lora_quantization_overrides(config, rank, targets, fp4_kernel, humming_ahead=humming_ahead,
                                            expand_in_gemm=expand_in_gemm)  # fmt: skip
    return {"quantization": QUANT_NAME, "hf_overrides": overrides}


def log_expand_in_gemm(layers: dict[str, str | None]) -> None:
    """Say how many LoRA'd linears run their expand inside Humming's GEMM (``vllm_lora_expand_in_gemm``) and why the
    others do not; a warning when none does (the option then changes nothing)."""
    why = sorted({w for w in layers.values() if w is not None})
    inside = sum(w is None for w in layers.values())
    text = (f"vllm_lora_expand_in_gemm: {inside} of {len(layers)} LoRA'd linears run the LoRA's expand inside "
            f"Humming's GEMM" + (f"; the rest keep the two launches ({'; '.join(why)})" if why else ""))
    (logger.info if inside else logger.warning)(text)


class InLayerLoRABackend(VLLMLoRABackend):
    """QeRL's ``qerl_nvfp4_lora`` layers: the LoRA copied into the engine's linears each round."""

    uses_lora_request = False

    def engine_kwargs(self, model: nn.Module) -> dict[str, Any]:
        humming = self.spec.fp4_kernel == "humming"
        return single_lora_engine_kwargs(self.spec.checkpoint, model, self.spec.fp4_kernel,
                                         humming_ahead=self.spec.humming_ahead and humming,
                                         expand_in_gemm=self.spec.expand_in_gemm and humming)  # fmt: skip

    def attach(self, llm: Any) -> None:
        super().attach(llm)
        if self.spec.expand_in_gemm and self.spec.fp4_kernel == "humming":
            from ...vllm_plugin.humming_tail import expand_in_gemm_layers

            log_expand_in_gemm(llm.apply_model(expand_in_gemm_layers)[0])

    def sync(self, model: nn.Module, gather_params: GatherParams) -> None:
        with gather_params(self.lora_parameters(model)):  # copied into the engine's layers while gathered
            self.push(*peft_lora_modules(model))
        return None

    def push(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float = 1.0) -> int:
        """Copy the LoRA into the engine's layers in place (every module must land)."""
        from ...vllm_plugin.single_lora import push_lora_in_place

        return sum(self.llm.apply_model(lambda model: push_lora_in_place(model, adapters, scaling)))

    def clear(self) -> int:
        n = self.push({})  # every LoRA slot missing from the push is zeroed
        self.llm.reset_prefix_cache()  # cached KV was computed with the LoRA
        return n
