"""NVFP4: the format (plain torch), the frozen linear layer, and the matmul dispatch point."""

from .format import (
    BLOCK_SIZE,
    NVFP4Weight,
    compute_global_scale,
    dequantize,
    pack_fp4,
    quantize,
    unpack_fp4,
)
from .linear import NVFP4Linear
from .ops import Backend, nvfp4_linear_dgrad, nvfp4_linear_forward, register_backend

__all__ = [
    "BLOCK_SIZE",
    "Backend",
    "NVFP4Linear",
    "NVFP4Weight",
    "compute_global_scale",
    "dequantize",
    "nvfp4_linear_dgrad",
    "nvfp4_linear_forward",
    "pack_fp4",
    "quantize",
    "register_backend",
    "unpack_fp4",
]
