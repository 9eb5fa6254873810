"""The one dispatch point for NVFP4 matmuls: reference (dequantize + matmul) or a registered fast backend.

``NVFP4Linear`` calls :func:`nvfp4_linear_forward` (``y = x @ Ŵᵀ``) and :func:`nvfp4_linear_dgrad`
(``dx = dy @ Ŵ``). The reference path works on any device; fast kernels (Triton, for CUDA) register
themselves with :func:`register_backend` and are picked when their ``supports`` predicate accepts the call.
Set ``QERL_NVFP4_BACKEND=reference`` to force the reference path (debugging, A/B timing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from .format import dequantize

MatmulFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Backend:
    name: str
    forward: MatmulFn  # (x [M, K], packed [N, K/2], scale [N, K/16], global [1]) -> y [M, N]
    dgrad: MatmulFn  # (dy [M, N], packed [N, K/2], scale [N, K/16], global [1]) -> dx [M, K]
    supports: Callable[[torch.Tensor, torch.Tensor], bool]  # (activation, packed) -> bool


_BACKENDS: list[Backend] = []


def register_backend(backend: Backend) -> None:
    """Add a fast backend; later registrations take precedence."""
    _BACKENDS.insert(0, backend)


def _pick(x: torch.Tensor, packed: torch.Tensor) -> Backend | None:
    if os.environ.get("QERL_NVFP4_BACKEND", "auto") == "reference":
        return None
    for b in _BACKENDS:
        if b.supports(x, packed):
            return b
    return None


def reference_forward(x2d, packed, scale, global_scale):
    w = dequantize(packed, scale, global_scale, dtype=x2d.dtype)
    return x2d @ w.t()


def reference_dgrad(dy2d, packed, scale, global_scale):
    w = dequantize(packed, scale, global_scale, dtype=dy2d.dtype)
    return dy2d @ w


def nvfp4_linear_forward(x: torch.Tensor, packed, scale, global_scale) -> torch.Tensor:
    """``x [..., K] @ Ŵᵀ -> [..., N]`` without ever keeping Ŵ beyond this call."""
    x2d = x.reshape(-1, x.shape[-1])
    b = _pick(x2d, packed)
    y = (b.forward if b else reference_forward)(x2d, packed, scale, global_scale)
    return y.reshape(*x.shape[:-1], packed.shape[0])


def nvfp4_linear_dgrad(dy: torch.Tensor, packed, scale, global_scale) -> torch.Tensor:
    """``dy [..., N] @ Ŵ -> [..., K]``: the input gradient, dequantizing again instead of saving Ŵ."""
    dy2d = dy.reshape(-1, dy.shape[-1])
    b = _pick(dy2d, packed)
    dx = (b.dgrad if b else reference_dgrad)(dy2d, packed, scale, global_scale)
    return dx.reshape(*dy.shape[:-1], packed.shape[1] * 2)


def active_backend_name(x: torch.Tensor, packed: torch.Tensor) -> str:
    b = _pick(x.reshape(-1, x.shape[-1]), packed)
    return b.name if b else "reference"


# --------------------------------------------------------------------------------------------- Triton backend
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_TRITON_OK: bool | None = None
#: Above this many rows the Triton backend always dequantizes Ŵ with one memory-bound kernel and hands it to
#: cuBLAS: there the tensor cores set the time, and the fused kernels, which cannot overlap dequantization with
#: Hopper's asynchronous MMA, lose to cuBLAS by 2.5-4.1x (H200, benchmarks/results/train_matmul-h200.json).
#: At or below it, the first call per (pass, M bucket, weight shape, dtype) times both paths and keeps the faster.
FUSED_CANDIDATE_MAX_M = 256
_PATHS: dict[tuple, str] = {}


def triton_path(kind: str, a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                global_scale: torch.Tensor) -> str:
    """``"fused"`` (Triton kernels that never write Ŵ) or ``"dequant_mm"`` (Triton dequantize + cuBLAS) for this
    call. ``QERL_NVFP4_FUSED_MAX_M=<rows>`` replaces the timing with a fixed threshold (reproducible numerics)."""
    m = a.shape[0]
    forced = os.environ.get("QERL_NVFP4_FUSED_MAX_M")
    if forced is not None:
        return "fused" if m <= int(forced) else "dequant_mm"
    if m > FUSED_CANDIDATE_MAX_M:
        return "dequant_mm"
    from .triton_kernels import m_bucket

    key = (kind, m_bucket(m), tuple(packed.shape), a.dtype, a.device)
    if key not in _PATHS:
        if torch.cuda.is_current_stream_capturing():  # cannot time inside a CUDA graph capture: warm up first
            return "fused"
        _PATHS[key] = _time_paths(kind, a, packed, scale, global_scale)
    return _PATHS[key]


def dequant_matmul(kind: str, a: torch.Tensor, packed, scale, global_scale) -> torch.Tensor:
    """The large-M path: Triton dequantizes Ŵ in one pass, cuBLAS multiplies (``a @ Ŵᵀ`` or ``a @ Ŵ``)."""
    from .triton_kernels import nvfp4_dequantize

    w = nvfp4_dequantize(packed, scale, global_scale, dtype=a.dtype)
    return a @ (w.t() if kind == "fwd" else w)


def _fused(kind: str):
    from . import triton_kernels as tk

    return tk.nvfp4_matmul_fwd if kind == "fwd" else tk.nvfp4_matmul_dgrad


def _time_paths(kind, a, packed, scale, gs) -> str:
    import triton

    fused = _fused(kind)
    with torch.no_grad():
        t_fused = triton.testing.do_bench(lambda: fused(a, packed, scale, gs), warmup=10, rep=40)
        t_dq = triton.testing.do_bench(lambda: dequant_matmul(kind, a, packed, scale, gs), warmup=10, rep=40)
    return "fused" if t_fused <= t_dq else "dequant_mm"


def _triton_supports(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """CUDA bf16/fp16 activations on sm_80+ with Triton installed; anything else keeps the reference path."""
    global _TRITON_OK
    if not x.is_cuda:  # cheap test first: CPU never imports Triton here
        return False
    if _TRITON_OK is None:
        _TRITON_OK = _triton_available()
    if not _TRITON_OK:
        return False
    from . import triton_kernels

    return triton_kernels.supported(x, packed)


def _triton_matmul(kind: str, a, packed, scale, global_scale):
    if triton_path(kind, a, packed, scale, global_scale) == "dequant_mm":
        return dequant_matmul(kind, a, packed, scale, global_scale)
    return _fused(kind)(a, packed, scale, global_scale)


def _triton_forward(x2d, packed, scale, global_scale):
    return _triton_matmul("fwd", x2d, packed, scale, global_scale)


def _triton_dgrad(dy2d, packed, scale, global_scale):
    return _triton_matmul("dgrad", dy2d, packed, scale, global_scale)


register_backend(Backend(name="triton", forward=_triton_forward, dgrad=_triton_dgrad, supports=_triton_supports))
