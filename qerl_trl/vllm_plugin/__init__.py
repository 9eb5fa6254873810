"""QeRL's vLLM plugin: code that runs inside the vLLM engine.

vLLM loads :func:`register` through its ``vllm.general_plugins`` entry point (``pyproject.toml``) in every engine
process; QeRL's trainer also calls it before building its colocated engine. Importing this package does not import
vLLM; :mod:`.lora_shards` (the LoRA layout math) needs only torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

QUANT_NAME = "qerl_nvfp4_lora"  # the quantization method's name in vLLM
LORA_KEY = "qerl_lora"  # its LoRA spec inside the checkpoint's quantization_config
#: What every "this LoRA or model cannot be served in-layer" error ends with: the other backend serves it
OTHER_BACKEND_HINT = "QeRLGRPOConfig(vllm_lora_backend='vllm') serves it through vLLM's own LoRA adapters instead."


def register(strict: bool = False) -> None:
    """Register the ``qerl_nvfp4_lora`` quantization method with vLLM (idempotent).

    vLLM calls this, unguarded, at every engine start of anyone who has qerl-trl installed, so by default a failure
    (another vLLM version, say) is logged and the engine starts without our method. QeRL's trainer, which needs the
    method, calls it with ``strict=True`` and gets the error.
    """
    try:
        from . import single_lora  # noqa: F401  (the decorator registers it)
    except Exception:
        if strict:
            raise
        import logging

        logging.getLogger(__name__).exception(
            "qerl-trl: could not register the vLLM quantization method %r; vllm_lora_backend='qerl' will not work "
            "in this engine", QUANT_NAME,
        )


def lora_quantization_overrides(checkpoint_config: Mapping[str, Any], rank: int, target_modules: Iterable[str]) -> dict:
    """``hf_overrides`` for ``LLM(...)``: the checkpoint's ``quantization_config`` plus the LoRA's rank and targets
    (leaf module names such as ``q_proj``)."""
    quant = checkpoint_config.get("quantization_config")
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "compressed-tensors":
        raise ValueError(
            f"The single-LoRA vLLM path serves compressed-tensors NVFP4A16 checkpoints; this one has "
            f"quantization_config={quant!r}. {OTHER_BACKEND_HINT}"
        )
    targets = sorted(set(target_modules))
    if not targets:
        raise ValueError("The LoRA targets no module.")
    return {"quantization_config": {**quant, LORA_KEY: {"rank": int(rank), "target_modules": targets}}}
