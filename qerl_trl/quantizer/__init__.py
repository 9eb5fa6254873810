"""transformers integration of NVFP4: ``NVFP4Config``, its ``HfQuantizer``, compressed-tensors checkpoints, and
converting a 16-bit (or GGUF) checkpoint on disk to one (``quantize_checkpoint``).

Importing this package registers quant_method ``"qerl_nvfp4"`` with transformers' public registries; no other
quantization method, config or checkpoint kind is touched.
"""

from __future__ import annotations

from .checkpoint import checkpoint_plan, compressed_tensors_config, load_nvfp4, nvfp4a16_problems
from .checkpoint_conversion import gguf_to_16bit, quantize_checkpoint
from .config import DEFAULT_FUSED_GROUPS, QUANT_METHOD, NVFP4Config
from .in_place import quantize_model
from .hf_quantizer import NVFP4HfQuantizer
from . import compat

compat.register(NVFP4Config, NVFP4HfQuantizer, QUANT_METHOD)

__all__ = [
    "DEFAULT_FUSED_GROUPS",
    "checkpoint_plan",
    "NVFP4Config",
    "NVFP4HfQuantizer",
    "QUANT_METHOD",
    "compressed_tensors_config",
    "gguf_to_16bit",
    "load_nvfp4",
    "nvfp4a16_problems",
    "quantize_checkpoint",
    "quantize_model",
]
