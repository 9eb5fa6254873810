"""The ``qerl_nvfp4_lora`` quantization method as the trainer asks vLLM for it: its name, and the LoRA spec it
reads from the checkpoint's ``quantization_config``.

Imports no vLLM: the trainer builds its engine arguments from here, and :mod:`.single_lora` (inside the engine)
reads the same names, so both sides agree without either importing the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["LORA_KEY", "LORA_OPS_VERSION", "OTHER_BACKEND_HINT", "QUANT_NAME", "lora_quantization_overrides"]

QUANT_NAME = "qerl_nvfp4_lora"  # the quantization method's name in vLLM
LORA_KEY = "qerl_lora"  # its LoRA spec inside the checkpoint's quantization_config
#: The version of the ops the in-layer LoRA puts into vLLM's compiled graph (2: the shrink on a side stream and an
#: in-place expand, ``lora_kernels``). It is part of the spec, so a change of the ops changes ``hf_overrides`` and with
#: it the compile-cache key (``compile_cache_marker``): a cache filled by older ops is never read.
LORA_OPS_VERSION = 2
#: What every "this LoRA or model cannot be served in-layer" error ends with: the other backend serves it
OTHER_BACKEND_HINT = "QeRLGRPOConfig(vllm_lora_backend='vllm') serves it through vLLM's own LoRA adapters instead."


def lora_quantization_overrides(
    checkpoint_config: Mapping[str, Any], rank: int, target_modules: Iterable[str], fp4_kernel: str = "marlin"
) -> dict:
    """``hf_overrides`` for ``LLM(...)``: the checkpoint's ``quantization_config`` plus the LoRA's rank and targets
    (leaf module names such as ``q_proj``) and the FP4 kernel (``"humming"``: Humming on every layer whose shape it
    takes, Marlin on the rest; ``"marlin"``: Marlin everywhere; see :mod:`.fp4_kernel`)."""
    quant = checkpoint_config.get("quantization_config")
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "compressed-tensors":
        raise ValueError(
            f"The single-LoRA vLLM path serves compressed-tensors NVFP4A16 checkpoints; this one has "
            f"quantization_config={quant!r}. {OTHER_BACKEND_HINT}"
        )
    targets = sorted(set(target_modules))
    if not targets:
        raise ValueError("The LoRA targets no module.")
    if fp4_kernel not in ("humming", "marlin"):
        raise ValueError(f"fp4_kernel must be 'humming' or 'marlin' (resolved from 'auto' first), got {fp4_kernel!r}.")
    spec = {"rank": int(rank), "target_modules": targets, "fp4_kernel": fp4_kernel, "ops": LORA_OPS_VERSION}
    return {"quantization_config": {**quant, LORA_KEY: spec}}
