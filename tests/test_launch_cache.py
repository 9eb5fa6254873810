"""The per-call caches on the matmul hot path: ``_launch.KernelLauncher`` and ``ops``' plan cache (CPU only).

``KernelLauncher`` is exercised with a stand-in for a Triton JIT function, which records how each launch went:
through Triton's binding (``fn[grid](...)``) or straight to the compiled kernel. Real kernels are compared with
and without it on the GPU (``test_gluon_kernels.py`` / ``test_triton_kernels.py``).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from qerl_trl.nvfp4 import ops
from qerl_trl.nvfp4._launch import KernelLauncher
from qerl_trl.nvfp4.format import quantize


class _Param:
    def __init__(self, name, constexpr, default=inspect.Parameter.empty):
        self.name, self.is_constexpr, self.default = name, constexpr, default
        self.has_default = default is not inspect.Parameter.empty


class _Compiled:
    function = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class _FakeJIT:
    """Signature (x_ptr, n, BLOCK: constexpr, FLAG: constexpr = 7)."""

    def __init__(self, params=None):
        self.params = params or [_Param("x_ptr", False), _Param("n", False), _Param("BLOCK", True),
                                 _Param("FLAG", True, 7)]
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _Compiled(self.log)
        return run


def test_second_launch_skips_binding_and_passes_constexprs_in_order():
    fn = _FakeJIT()
    launch = KernelLauncher(fn)
    x = torch.zeros(64)
    launch((4, 2), (x, 10), "cfg", dict(BLOCK=32), dict(num_warps=4))
    launch((5,), (x, 10), "cfg", dict(BLOCK=32), dict(num_warps=4))
    assert fn.log[0] == ("jit", (4, 2), (x, 10), dict(BLOCK=32, num_warps=4))
    kind, grid, args = fn.log[1]
    assert kind == "direct" and grid == (5, 1, 1) and args == (x, 10, 32, 7)  # FLAG's default filled in


@pytest.mark.parametrize("change", ["int", "dtype", "alignment", "config"])
def test_anything_triton_specializes_on_takes_the_jit_path_again(change):
    fn = _FakeJIT()
    launch = KernelLauncher(fn)
    x = torch.zeros(64)
    launch((1,), (x, 10), "cfg", dict(BLOCK=32))
    args, cfg = (x, 10), "cfg"
    if change == "int":
        args = (x, 16)
    elif change == "dtype":
        args = (x.half(), 10)
    elif change == "alignment":
        args = (x[1:], 10)  # 4 bytes off a 16-byte boundary
    else:
        cfg = "other"
    launch((1,), args, cfg, dict(BLOCK=32))
    assert [e[0] for e in fn.log] == ["jit", "jit"]
    launch((1,), args, cfg, dict(BLOCK=32))
    assert fn.log[-1][0] == "direct"


def test_launch_hooks_force_the_jit_path(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    fn = _FakeJIT()
    launch = KernelLauncher(fn)
    x = torch.zeros(64)
    launch((1,), (x, 3), "cfg", dict(BLOCK=32))
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    launch((1,), (x, 3), "cfg", dict(BLOCK=32))
    assert [e[0] for e in fn.log] == ["jit", "jit"]  # a profiler sees every launch


def test_unusual_signatures_are_never_cached():
    fn = _FakeJIT([_Param("BLOCK", True), _Param("x_ptr", False), _Param("n", False)])  # constexpr first
    launch = KernelLauncher(fn)
    x = torch.zeros(64)
    for _ in range(3):
        launch((1,), (x, 3), "cfg", dict(BLOCK=32))
    assert [e[0] for e in fn.log] == ["jit"] * 3
    with pytest.raises(TypeError, match="cannot key"):
        launch((1,), (x, object()), "cfg", dict(BLOCK=32))


def test_ops_plan_is_decided_once_per_key(monkeypatch):
    """A registered backend's ``supports``/``resolve`` run once per (shape, dtype, device, alignment, env) key."""
    calls = []

    def supports(x, packed):
        calls.append("supports")
        return x.dtype == torch.float16

    def resolve(kind, a, packed, scale, gs):
        calls.append("resolve")
        return (lambda a, p, s, g: torch.full((a.shape[0], p.shape[0]), 3.0, dtype=a.dtype)), True

    backend = ops.Backend("fake", forward=None, dgrad=None, supports=supports, resolve=resolve)
    monkeypatch.setattr(ops, "_BACKENDS", [backend])
    monkeypatch.setattr(ops, "_PLANS", {})
    q = quantize(torch.randn(32, 64))
    x = torch.randn(5, 64, dtype=torch.float16)
    for _ in range(3):
        assert (ops.nvfp4_linear_forward(x, *q) == 3).all()
    assert calls == ["supports", "resolve"]
    ops.nvfp4_linear_forward(torch.randn(2, 3, 64, dtype=torch.float16), *q)  # other row count: new plan
    assert calls.count("resolve") == 2
    xb = x.bfloat16()  # the backend declines: reference path, and that decision is cached too
    ref = ops.reference_forward(xb, *q)
    assert torch.equal(ops.nvfp4_linear_forward(xb, *q), ref) and calls.count("supports") == 3
    ops.nvfp4_linear_forward(xb, *q)
    assert calls.count("supports") == 3
    monkeypatch.setenv("QERL_NVFP4_BACKEND", "reference")  # env switches are part of the key
    assert torch.equal(ops.nvfp4_linear_forward(x, *q), ops.reference_forward(x, *q))


def test_ops_plan_not_cached_when_backend_says_provisional(monkeypatch):
    """Inside a CUDA-graph capture the Triton backend cannot time its candidates: it answers for this call only."""
    calls = []

    def resolve(kind, a, packed, scale, gs):
        calls.append(kind)
        return ops.reference_forward if kind == "fwd" else ops.reference_dgrad, False

    backend = ops.Backend("fake", forward=None, dgrad=None, supports=lambda x, p: True, resolve=resolve)
    monkeypatch.setattr(ops, "_BACKENDS", [backend])
    monkeypatch.setattr(ops, "_PLANS", {})
    q = quantize(torch.randn(32, 64))
    x = torch.randn(4, 64)
    ops.nvfp4_linear_forward(x, *q)
    ops.nvfp4_linear_forward(x, *q)
    ops.nvfp4_linear_dgrad(torch.randn(4, 32), *q)
    assert calls == ["fwd", "fwd", "dgrad"]
