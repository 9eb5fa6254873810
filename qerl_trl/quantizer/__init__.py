"""transformers integration of NVFP4: ``NVFP4Config``, its ``HfQuantizer``, and compressed-tensors checkpoints.

Importing this package registers quant_method ``"qerl_nvfp4"`` with transformers' public registries; no other
quantization method, config or checkpoint kind is touched.
"""

from __future__ import annotations

from .checkpoint import checkpoint_plan, compressed_tensors_config, load_nvfp4, nvfp4a16_problems
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
    "load_nvfp4",
    "nvfp4a16_problems",
    "quantize_model",
]
