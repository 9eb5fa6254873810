"""The one dispatch point for NVFP4 matmuls: reference (dequantize + matmul) or a registered fast backend.

``NVFP4Linear`` calls :func:`nvfp4_linear_forward` (``y = x @ Ŵᵀ``) and :func:`nvfp4_linear_dgrad`
(``dx = dy @ Ŵ``). The reference path works on any device; fast CUDA kernels (Triton, and Gluon on Hopper)
register themselves with :func:`register_backend` and are picked when their ``supports`` predicate accepts the
call. On CUDA the Triton backend runs two paths: dequantize + cuBLAS (every training matmul), and the Gluon
skinny forward for decode-sized rows where it is faster.
Set ``QERL_NVFP4_BACKEND=reference`` to force the reference path (debugging, A/B timing), ``QERL_NVFP4_GLUON=0``
to keep the Gluon kernel out.
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
    #: optional (kind, a, packed, scale, global) -> (entry point for this call, whether it may be reused for
    #: every call with the same plan key); without it the plan is ``forward`` / ``dgrad``
    resolve: Callable[..., tuple[MatmulFn, bool]] | None = None


_BACKENDS: list[Backend] = []
#: (pass, rows, weight shape, dtypes, devices, 16-byte alignments, env switches) -> the entry point to call.
#: Everything a backend's ``supports`` and path choice look at is in the key, so each matmul costs one dict lookup
#: instead of re-running every ``supports`` check and the path choice on each call.
_PLANS: dict[tuple, MatmulFn] = {}
_ENV_SWITCHES = ("QERL_NVFP4_BACKEND", "QERL_NVFP4_GLUON")


def register_backend(backend: Backend) -> None:
    """Add a fast backend; later registrations take precedence."""
    _BACKENDS.insert(0, backend)
    _PLANS.clear()


def _pick(x: torch.Tensor, packed: torch.Tensor) -> Backend | None:
    if os.environ.get("QERL_NVFP4_BACKEND", "auto") == "reference":
        return None
    for b in _BACKENDS:
        if b.supports(x, packed):
            return b
    return None


def dequantize_stack(like: torch.Tensor, packed, scale, global_scale) -> torch.Tensor:
    """Dense ``[E, N, K]`` of a stack of NVFP4 weights (one global scale an expert) in ``like``'s dtype: one Triton
    launch where the Triton backend runs ``like``, else the reference an expert at a time (bit-identical). For the
    grouped experts of :mod:`.experts`."""
    if _pick(like, packed[0]) is not None and _triton_supports(like, packed[0]):
        from .triton_kernels import nvfp4_dequantize_stack

        return nvfp4_dequantize_stack(packed, scale, global_scale, dtype=like.dtype)
    return torch.stack([dequantize(packed[e], scale[e], global_scale[e : e + 1], dtype=like.dtype)
                        for e in range(packed.shape[0])])  # fmt: skip


def reference_forward(x2d, packed, scale, global_scale):
    w = dequantize(packed, scale, global_scale, dtype=x2d.dtype)
    return x2d @ w.t()


def reference_dgrad(dy2d, packed, scale, global_scale):
    w = dequantize(packed, scale, global_scale, dtype=dy2d.dtype)
    return dy2d @ w


def _plan(kind: str, a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor) -> MatmulFn:
    """The entry point for this call, decided once per plan key (see ``_PLANS``)."""
    get = os.environ.get
    key = (kind, a.shape, packed.shape, a.dtype, packed.dtype, a.get_device(), packed.get_device(),
           a.data_ptr() % 16, packed.data_ptr() % 16, scale.data_ptr() % 16, *(get(e) for e in _ENV_SWITCHES))
    fn = _PLANS.get(key)
    if fn is None:
        b = _pick(a, packed)
        if b is None:
            fn, final = (reference_forward if kind == "fwd" else reference_dgrad), True
        elif b.resolve is not None:
            fn, final = b.resolve(kind, a, packed, scale, gs)
        else:
            fn, final = (b.forward if kind == "fwd" else b.dgrad), True
        if final:
            _PLANS[key] = fn
    return fn


def nvfp4_linear_forward(x: torch.Tensor, packed, scale, global_scale) -> torch.Tensor:
    """``x [..., K] @ Ŵᵀ -> [..., N]`` without ever keeping Ŵ beyond this call."""
    x2d = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
    y = _plan("fwd", x2d, packed, scale, global_scale)(x2d, packed, scale, global_scale)
    return y if x.ndim == 2 else y.reshape(*x.shape[:-1], packed.shape[0])


def nvfp4_linear_dgrad(dy: torch.Tensor, packed, scale, global_scale) -> torch.Tensor:
    """``dy [..., N] @ Ŵ -> [..., K]``: the input gradient, dequantizing again instead of saving Ŵ."""
    dy2d = dy if dy.ndim == 2 else dy.reshape(-1, dy.shape[-1])
    dx = _plan("dgrad", dy2d, packed, scale, global_scale)(dy2d, packed, scale, global_scale)
    return dx if dy.ndim == 2 else dx.reshape(*dy.shape[:-1], packed.shape[1] * 2)


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
#: (pass, M bucket, weight shape, dtype, device) -> the path chosen for it.
_PATHS: dict[tuple, str] = {}


def _candidates(kind: str, a: torch.Tensor, packed: torch.Tensor) -> list[str]:
    """Paths that can run this call, in order of preference when they cannot be timed (CUDA-graph capture).

    Only paths that win on a product path are here (``benchmarks/results/train_matmul-h200.json``):
    ``dequant_mm`` (Triton dequantize + cuBLAS) for every training matmul, and the Gluon ``skinny`` forward for
    decode-sized rows (generation without vLLM)."""
    from . import gluon_kernels as gk

    out = []
    if kind == "fwd" and gk.skinny_supported(a, packed):
        out.append("skinny")
    out.append("dequant_mm")
    return out


def triton_path(kind: str, a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                global_scale: torch.Tensor) -> str:
    """``"skinny"`` (Gluon forward for <= 64 rows) or ``"dequant_mm"`` (Triton dequantize + cuBLAS) for this call.
    Where both can run, the first call per (pass, M bucket, weight shape, dtype) times them and keeps the
    faster."""
    return _triton_decision(kind, a, packed, scale, global_scale)[0]


def _triton_decision(kind, a, packed, scale, global_scale) -> tuple[str, bool]:
    """(path, final): final is False only inside a CUDA-graph capture before this bucket was timed."""
    from .triton_kernels import m_bucket

    key = (kind, m_bucket(a.shape[0]), tuple(packed.shape), a.dtype, a.device)
    if key not in _PATHS:
        cands = _candidates(kind, a, packed)
        if len(cands) == 1:
            _PATHS[key] = cands[0]
        elif torch.cuda.is_current_stream_capturing():  # cannot time inside a CUDA graph capture: warm up first
            return cands[0], False
        else:
            _PATHS[key] = _time_paths(kind, a, packed, scale, global_scale, cands)
    return _PATHS[key], True


def dequant_matmul(kind: str, a: torch.Tensor, packed, scale, global_scale) -> torch.Tensor:
    """Triton dequantizes Ŵ in one pass, cuBLAS multiplies (``a @ Ŵᵀ`` or ``a @ Ŵ``); only one layer's Ŵ exists
    at a time and it is freed after the matmul."""
    from .triton_kernels import nvfp4_dequantize

    w = nvfp4_dequantize(packed, scale, global_scale, dtype=a.dtype)
    return a @ (w.t() if kind == "fwd" else w)


_PATH_FNS: dict[tuple[str, str], MatmulFn] = {}


def _path_fn(kind: str, path: str) -> MatmulFn:
    """The entry point of ``path`` for ``kind`` (resolved once: this runs on every matmul)."""
    fn = _PATH_FNS.get((kind, path))
    if fn is None:
        from . import gluon_kernels as gk

        fn = {
            ("fwd", "dequant_mm"): lambda a, p, s, g: dequant_matmul("fwd", a, p, s, g),
            ("dgrad", "dequant_mm"): lambda a, p, s, g: dequant_matmul("dgrad", a, p, s, g),
            ("fwd", "skinny"): gk.nvfp4_matmul_fwd_skinny,
        }[(kind, path)]
        _PATH_FNS[(kind, path)] = fn
    return fn


#: Up to this many rows the candidates are timed replayed from a CUDA graph: such matmuls take ~10 µs, so eager
#: timing mostly measures Python launch cost.
GRAPH_TIMED_MAX_M = 64


def _time_paths(kind, a, packed, scale, gs, candidates) -> str:
    import triton

    best, best_t = candidates[0], float("inf")
    with torch.no_grad():
        for path in candidates:
            fn = _path_fn(kind, path)
            call = lambda: fn(a, packed, scale, gs)  # noqa: E731
            if a.shape[0] <= GRAPH_TIMED_MAX_M:
                call()  # compile outside the capture
                t = triton.testing.do_bench_cudagraph(call, rep=20)
            else:
                t = triton.testing.do_bench(call, warmup=10, rep=40)
            if t < best_t:
                best, best_t = path, t
    return best


def clear_plans() -> None:
    """Forget every dispatch decision (tests, and after changing the environment switches)."""
    _PLANS.clear()
    _PATHS.clear()


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


def _triton_resolve(kind: str, a, packed, scale, global_scale) -> tuple[MatmulFn, bool]:
    path, final = _triton_decision(kind, a, packed, scale, global_scale)
    return _path_fn(kind, path), final


def _triton_matmul(kind: str, a, packed, scale, global_scale):
    return _triton_resolve(kind, a, packed, scale, global_scale)[0](a, packed, scale, global_scale)


def _triton_forward(x2d, packed, scale, global_scale):
    return _triton_matmul("fwd", x2d, packed, scale, global_scale)


def _triton_dgrad(dy2d, packed, scale, global_scale):
    return _triton_matmul("dgrad", dy2d, packed, scale, global_scale)


register_backend(Backend(name="triton", forward=_triton_forward, dgrad=_triton_dgrad, supports=_triton_supports,
                         resolve=_triton_resolve))
