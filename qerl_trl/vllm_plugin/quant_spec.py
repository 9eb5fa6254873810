"""The ``qerl_nvfp4_lora`` quantization method as the trainer asks vLLM for it: its name, and the LoRA spec it
reads from the checkpoint's ``quantization_config``.

Imports no vLLM: the trainer builds its engine arguments from here, and :mod:`.single_lora` (inside the engine)
reads the same names, so both sides agree without either importing the other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["LORA_KEY", "LORA_OPS_SOURCES", "LORA_OPS_VERSION", "OTHER_BACKEND_HINT", "QUANT_NAME", "lora_ops_digest",
           "lora_quantization_overrides"]

QUANT_NAME = "qerl_nvfp4_lora"  # the quantization method's name in vLLM
LORA_KEY = "qerl_lora"  # its LoRA spec inside the checkpoint's quantization_config
#: The plugin's files whose code the in-layer LoRA puts into vLLM's compiled graph: the custom ops, the quantization
#: method that calls them (with its FP4-kernel choice) and the buffers it fills. Checked by a test against what
#: ``single_lora`` imports from the package, so a new file cannot be left out.
LORA_OPS_SOURCES = ("fp4_kernel.py", "humming_ahead.py", "humming_tail.py", "lora_kernels.py", "lora_shards.py",
                    "single_lora.py")


def lora_ops_digest(sources: Iterable[str] = LORA_OPS_SOURCES, root: Path | None = None) -> str:
    """A hash of the bytes of :data:`LORA_OPS_SOURCES` (in ``root``, this package's folder by default): what the ops
    are, not a number someone must remember to bump (a hand-kept version once stayed at 2 while the ops changed)."""
    here = root or Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in sorted(sources):
        h.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


#: The ops' identity in the LoRA spec. It is part of ``hf_overrides``, and with them of the compile-cache key
#: (``compile_cache_marker``): an engine never replays a graph compiled for other ops.
LORA_OPS_VERSION = lora_ops_digest()
#: What every "this LoRA or model cannot be served in-layer" error ends with: the other backend serves it
OTHER_BACKEND_HINT = "QeRLGRPOConfig(vllm_lora_backend='vllm') serves it through vLLM's own LoRA adapters instead."


def lora_quantization_overrides(
    checkpoint_config: Mapping[str, Any], rank: int, target_modules: Iterable[str], fp4_kernel: str = "marlin",
    humming_ahead: bool = False, expand_in_gemm: bool = False,
) -> dict:
    """``hf_overrides`` for ``LLM(...)``: the checkpoint's ``quantization_config`` plus the LoRA's rank and targets
    (leaf module names such as ``q_proj``) and the FP4 kernel (``"humming"``: Humming on every layer whose shape it
    takes, Marlin on the rest; ``"marlin"``: Marlin everywhere; see :mod:`.fp4_kernel`). ``humming_ahead``: fewer of
    Humming's kernels, compiled in the background from the weight load (:mod:`.humming_ahead`). ``expand_in_gemm``:
    the LoRA's B inside Humming's GEMM as extra input columns (:mod:`.humming_tail`)."""
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
    if humming_ahead:  # a new compile-cache key: the forward passes Humming the engine's table
        spec["humming_ahead"] = True
    if expand_in_gemm:  # a new compile-cache key too: other ops, wider Humming layers
        spec["expand_in_gemm"] = True
    return {"quantization_config": {**quant, LORA_KEY: spec}}
