"""qerl-trl: QeRL (NVFP4 base + BF16 LoRA + Adaptive Quantization Noise) for TRL's GRPO.

Importing ``qerl_trl`` registers the ``NVFP4Config`` quantization method with transformers; nothing else
changes for other checkpoints. Heavy parts (trainer, AQN) are imported lazily on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from .nvfp4 import NVFP4Linear  # noqa: E402

_LAZY = {
    "NVFP4Config": "qerl_trl.quantizer",
    "load_nvfp4": "qerl_trl.quantizer",
    "AQNSchedule": "qerl_trl.aqn",
    "AQNCallback": "qerl_trl.aqn",
    "QeRLGRPOConfig": "qerl_trl.trainer",
    "QeRLGRPOTrainer": "qerl_trl.trainer",
}

__all__ = ["NVFP4Linear", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qerl_trl' has no attribute {name!r}")


# Registers NVFP4Config / its HfQuantizer with transformers (quant_method "qerl_nvfp4").
try:  # the quantizer package lands in its own change; keep `import qerl_trl` working meanwhile
    importlib.import_module("qerl_trl.quantizer")
except ModuleNotFoundError as e:  # pragma: no cover
    if e.name != "qerl_trl.quantizer":
        raise

from . import peft_lora  # noqa: E402,F401  (registers the NVFP4 LoRA layer with PEFT; see peft_lora.py)
