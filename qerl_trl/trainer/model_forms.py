"""Every form of ``model=`` that TRL's ``GRPOTrainer`` accepts, brought to an NVFP4 base plus one LoRA.

* a model id/path: loaded through ``NVFP4Config`` (``policy.load_nvfp4_model``);
* a 16-bit ``PreTrainedModel``: quantized in place, one fused group at a time (``quantize_instance``);
* an NVFP4 ``PreTrainedModel`` (``from_pretrained(..., quantization_config=NVFP4Config())``): used as it is;
* a ``PeftModel`` (16-bit or NVFP4 base): its LoRA config and adapter weights are kept, its base is quantized
  like a 16-bit model, and the LoRA is put back (``split_peft_model`` / ``rewrap_peft_model``).

Everything that can be refused is refused before any weight is converted.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..nvfp4 import NVFP4Linear
from ..peft_lora import check_lora_config_for_nvfp4
from ..quantizer.moe import refuse_moe_config

logger = logging.getLogger(__name__)

#: the adapter name TRL trains (its reference copy is "ref"; vLLM sync reads "default")
ADAPTER = "default"


def has_nvfp4(model: nn.Module) -> bool:
    return any(isinstance(m, NVFP4Linear) for m in model.modules())


def quantize_instance(model: nn.Module, modules_to_not_convert: list[str] | None) -> None:
    """Quantize a user's 16-bit model to NVFP4 in place (peak: the model plus one fused group; see
    ``quantizer.quantize_model``). The caller's object is changed: its Linears become NVFP4Linear (and a
    Qwen3-MoE's experts NVFP4Experts; another MoE layout is refused first)."""
    from ..quantizer import NVFP4Config, quantize_model

    if getattr(model, "hf_quantizer", None) is not None and not has_nvfp4(model):
        method = getattr(model.hf_quantizer.quantization_config, "quant_method", "?")
        raise ValueError(
            f"The model is already quantized ({method}); QeRL needs a 16-bit model (quantized to NVFP4 here) or one "
            "loaded with quantization_config=qerl_trl.NVFP4Config()."
        )
    refuse_moe_config(model.config, type(model).__name__)
    plan = quantize_model(model, NVFP4Config(modules_to_not_convert=modules_to_not_convert))
    logger.info("QeRL: quantized the given model to NVFP4 in place (%d Linear layers)", len(plan.groups))


@dataclass
class SplitPeftModel:
    """A ``PeftModel`` taken apart: the bare base, the user's LoRA config, and the adapter's tensors."""

    base: nn.Module
    lora_config: Any
    adapter_state: dict[str, torch.Tensor]


def check_peft_model(model: Any) -> tuple[str, Any]:
    """Refuse, before any work, a ``PeftModel`` whose adapter an NVFP4 base cannot train; return its adapter."""
    configs = dict(model.peft_config)
    if len(configs) != 1:
        raise ValueError(
            f"The PeftModel has {len(configs)} adapters ({sorted(configs)}); QeRL trains one. Pass a PeftModel with "
            "the one adapter to train (model.delete_adapter(name) removes the others)."
        )
    (name, cfg), = configs.items()
    check_lora_config_for_nvfp4(cfg)
    return name, cfg


def split_peft_model(model: Any) -> SplitPeftModel:
    """Take the LoRA off a ``PeftModel`` (no merge), keeping its config (made trainable) and its tensors."""
    from peft.utils import get_peft_model_state_dict

    name, cfg = check_peft_model(model)
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}
    lora_config = copy.deepcopy(cfg)
    lora_config.inference_mode = False  # PeftModel.from_pretrained loads adapters frozen by default
    base = model.unload()  # drops the LoRA layers without merging (refused on NVFP4 bases anyway)
    if hasattr(base, "peft_config"):
        del base.peft_config
    return SplitPeftModel(base, lora_config, state)


def rewrap_peft_model(base: nn.Module, split: SplitPeftModel) -> Any:
    """Put the user's LoRA back on the (now NVFP4) base under TRL's adapter name, with its trained tensors."""
    from peft import get_peft_model
    from peft.utils import set_peft_model_state_dict

    model = get_peft_model(base, split.lora_config, adapter_name=ADAPTER)
    result = set_peft_model_state_dict(model, split.adapter_state, adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing:
        raise RuntimeError(f"could not put the adapter back on the NVFP4 base; missing {missing[:3]}")
    return model
