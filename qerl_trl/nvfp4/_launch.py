"""Launch a compiled Triton kernel again without re-binding its arguments (written against Triton 3.6).

``kernel[grid](*args, **constexprs)`` binds and specializes every argument, hashes every constexpr (Gluon layouts
included), looks the compiled kernel up and checks the globals it used, on every call: tens of µs of Python on
the GPU machine's host, which is more than a decode-sized matmul takes on the GPU (host costs per call:
``benchmarks/launch_overhead.py``). :class:`KernelLauncher` goes through Triton's own path once per
specialization and afterwards calls the compiled kernel's launcher directly (``CompiledKernel[grid](*args)``),
which costs about as much as one PyTorch op.

What makes two calls share a compiled kernel is exactly what Triton specializes on: each tensor's dtype and
whether its address is 16-byte aligned, each integer's value (we key on the value itself, which is stricter than
Triton's ``== 1`` / ``% 16`` classes), and the constexprs and launch options, which the caller names with a
cheap hashable ``config`` instead of having them hashed on every call. This is the only module that touches
Triton internals (``JITFunction.params``, ``CompiledKernel.__getitem__``, the hooks' serialization rule);
anything it does not recognise, a launch hook (profilers) or the interpreter sends back through ``kernel[grid]``.

Before a specialization first goes through Triton, its constexprs are checked to be JSON-serializable the way
Triton serializes them for its JIT hooks (:func:`check_constexprs_serializable`). Any library in the process can
install such a hook (vLLM's worker does after its warm-up), and Triton then serializes every later compile; a
constexpr it cannot serialize fails there, deep inside someone else's engine. The check fails on the first call
instead, on any machine, hook or not, naming the kernel and the constexpr.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch


def _arg_key(a: Any) -> Hashable:
    """What Triton specializes a runtime argument on (or something finer)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, (bool, int, float)) or a is None:
        return type(a), a
    base = getattr(a, "base", None)  # a host TensorDescriptor (TMA): dtype, alignment, geometry
    if isinstance(base, torch.Tensor):
        return (type(a).__name__, base.dtype, base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides),
                tuple(a.block_shape))
    raise TypeError(f"KernelLauncher cannot key an argument of type {type(a).__name__}")


def _hook_active(hook: Any) -> bool:
    """Triton >= 3.5 keeps hooks in a ``HookChain`` (active when it holds calls); older ones a callable or None."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def check_constexprs_serializable(kernel_name: str, constexprs: dict[str, Any]) -> None:
    """Raise a TypeError naming the constexpr if Triton could not JSON-serialize it for a JIT hook.

    Triton 3.6 (``runtime/jit.py``: ``JITFunction._call_hook`` -> ``serialize_specialization_data``) turns dtypes
    into strings and unwraps ``constexpr`` wrappers, then ``json.dumps`` every constexpr value, before calling any
    ``jit_cache_hook`` / ``jit_post_compile_hook``; the same rule is applied here."""
    import json

    for name, value in constexprs.items():
        kind = type(value).__name__
        v = str(value) if kind == "dtype" else value.value if kind == "constexpr" else value
        try:
            json.dumps(v)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"{kernel_name}: constexpr {name}={value!r} ({kind}) cannot be JSON-serialized, and Triton "
                "serializes every constexpr for the JIT hooks other libraries install (vLLM's worker does). Pass "
                "plain ints, floats, bools, strings or dtypes, and build layouts inside the kernel (see "
                "gluon_kernels._skinny_layout)."
            ) from e


_KNOBS: list = []


def _launch_hooks_set() -> bool:
    if not _KNOBS:
        try:
            from triton import knobs
        except ImportError:  # pragma: no cover - older Triton: no knobs, never fast-launch
            knobs = None
        _KNOBS.append(knobs)
    knobs = _KNOBS[0]
    if knobs is None:
        return True
    return _hook_active(knobs.runtime.launch_enter_hook) or _hook_active(knobs.runtime.launch_exit_hook)


class KernelLauncher:
    """``launcher(grid, args, config, constexprs, options)`` runs ``fn[grid](*args, **constexprs, **options)``.

    ``args`` are the runtime arguments, which must come first in the kernel's signature; ``constexprs`` the rest,
    by name; ``options`` the launch options (``num_warps``, ...). ``config`` must determine ``constexprs`` and
    ``options`` (it is hashed instead of them). The first call per (``config``, argument specialization) goes
    through Triton and is remembered; later ones launch the compiled kernel directly.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._kernels: dict[Hashable, tuple[Any, tuple]] = {}

    def __call__(self, grid: Sequence[int], args: Sequence[Any], config: Hashable, constexprs: dict[str, Any],
                 options: dict[str, Any] | None = None) -> None:
        key = (config, *map(_arg_key, args))
        hit = self._kernels.get(key)
        if hit is not None and not _launch_hooks_set():
            kernel, tail = hit
            kernel[(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)](*args, *tail)
            return
        if hit is None:
            check_constexprs_serializable(getattr(self.fn, "__name__", repr(self.fn)), constexprs)
        kernel = self.fn[tuple(grid)](*args, **constexprs, **(options or {}))
        tail = self._constexpr_tail(len(args), constexprs)
        if tail is not None and callable(getattr(kernel, "__getitem__", None)) and hasattr(kernel, "function"):
            self._kernels[key] = (kernel, tail)

    def _constexpr_tail(self, n_args: int, constexprs: dict[str, Any]) -> tuple | None:
        """Constexpr values in signature order after the runtime arguments, or None if the signature does not
        have that shape (then every call takes Triton's path)."""
        params = getattr(self.fn, "params", None)
        if params is None or any(p.is_constexpr for p in params[:n_args]):
            return None
        tail = []
        for p in params[n_args:]:
            if not p.is_constexpr:
                return None
            if p.name in constexprs:
                tail.append(constexprs[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return None
        return tuple(tail)

    def clear(self) -> None:
        self._kernels.clear()
