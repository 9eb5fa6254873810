"""The FP4 kernel of the trainer's engine, resolved on this machine from ``QeRLGRPOConfig.vllm_fp4_kernel``: the GPU,
whether ``humming-kernels`` is installed and the checkpoint's shapes (rules: :mod:`qerl_trl.vllm_plugin.fp4_kernel`).
"""

from __future__ import annotations

import json
import logging
import os

from ...vllm_plugin.fp4_kernel import (
    DECODER_LINEARS,
    FP4KernelChoice,
    choose_fp4_kernel,
    humming_cache_dir,
    humming_missing,
    installed_humming_version,
)

logger = logging.getLogger(__name__)

__all__ = ["require_humming_if_forced", "resolve_fp4_kernel"]


def require_humming_if_forced(requested: str) -> None:
    """Before any weight loads: ``vllm_fp4_kernel='humming'`` without the package is an error that says what to do."""
    if requested == "humming" and installed_humming_version() is None:
        raise humming_missing()


def _gpu_capability() -> tuple[int, int] | None:
    import torch

    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def _quantized_modules(config: dict) -> set[str] | None:
    """Leaf names of the decoder linears the checkpoint quantized (None: all), from compressed-tensors' ignore list."""
    ignore = (config.get("quantization_config") or {}).get("ignore") or []
    if not ignore:
        return None
    return {leaf for leaf in DECODER_LINEARS if not any(str(i).endswith(leaf) for i in ignore)}


def resolve_fp4_kernel(requested: str, lora_backend: str, checkpoint: str, tp_size: int = 1) -> FP4KernelChoice:
    """The kernel the engine will run, logged once with its reason (a warning when Humming must compile first)."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    choice = choose_fp4_kernel(
        requested, per_layer=lora_backend == "qerl", model_config=config, tp_size=tp_size,
        capability=_gpu_capability(), humming_version=installed_humming_version(),
        quantized_modules=_quantized_modules(config),
    )  # fmt: skip
    cache = humming_cache_dir()
    if choice.kernel == "humming" and not (os.path.isdir(cache) and os.listdir(cache)):
        logger.warning(
            "%s. That cache is empty: this first engine start compiles Humming's kernels, which takes minutes; later "
            "starts load them. Keep %s between runs (HUMMING_CACHE_DIR moves it).", choice.log_line(), cache,
        )
    else:
        logger.info("%s", choice.log_line())
    return choice
