"""NVFP4Linear: output and input grad equal the dense dequantized layer; nothing 16-bit is kept for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qerl_trl.nvfp4 import NVFP4Linear, nvfp4_linear_forward
from qerl_trl.nvfp4 import format as nvfp4

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def make(out_f=48, in_f=64, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    return lin, NVFP4Linear.from_linear(lin, name="test.proj.weight")


def test_holds_only_packed_tensors_and_is_frozen():
    lin, q = make(bias=True, dtype=torch.bfloat16)
    params = dict(q.named_parameters())
    assert set(params) == {"weight_packed", "weight_scale", "weight_global_scale", "bias"}
    assert params["weight_packed"].dtype == torch.uint8 and params["weight_packed"].shape == (48, 32)
    assert params["weight_scale"].dtype == torch.float8_e4m3fn and params["weight_scale"].shape == (48, 4)
    assert params["weight_global_scale"].dtype == torch.float32 and params["weight_global_scale"].shape == (1,)
    assert params["bias"].dtype == torch.bfloat16
    assert not any(p.requires_grad for p in q.parameters())
    assert list(q.buffers()) == []
    ref = nvfp4.quantize(lin.weight)
    assert torch.equal(q.weight_packed, ref.weight_packed)
    assert torch.equal(q.weight_scale.view(torch.uint8), ref.weight_scale.view(torch.uint8))
    assert set(q.state_dict()) == set(params)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_input_grad_match_dense_dequantized(dtype, bias):
    lin, q = make(bias=bias, dtype=dtype)
    w = q.dequantize(dtype)
    x = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)  # 3-D input
    xr = x.detach().clone().requires_grad_(True)
    y = q(x)
    yr = F.linear(xr, w)
    if bias:  # added after the matmul (one extra rounding in 16-bit vs. F.linear's fused bias)
        yr = yr + lin.bias
        assert torch.allclose(y, F.linear(xr, w, lin.bias), rtol=1e-2, atol=1e-2)
    assert y.dtype == dtype and y.shape == (3, 5, 48)
    assert torch.equal(y, yr)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    assert torch.equal(x.grad, xr.grad)


def test_input_grad_matches_autograd_reference_fp32():
    lin, q = make(bias=False, dtype=torch.float32)
    x = torch.randn(4, 64, dtype=torch.float64)
    w = q.dequantize(torch.float64)
    assert torch.autograd.gradcheck(
        lambda inp: q(inp.float()).double(), (x.clone().requires_grad_(True),), eps=1e-3, atol=1e-3
    )
    y = q(x.float().requires_grad_(True))
    assert torch.allclose(y.double(), x @ w.t(), atol=1e-4)


def test_no_dense_weight_saved_for_backward():
    lin, q = make(out_f=96, in_f=128, bias=True, dtype=torch.bfloat16)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(2, 7, 128, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = q(x)
    assert saved, "the autograd Function should save its packed tensors"
    for t in saved:
        assert not (t.is_floating_point() and t.dtype != torch.float8_e4m3fn and t.numel() >= 96 * 128), (
            f"a dense {t.dtype} {tuple(t.shape)} tensor is kept for backward"
        )
    kinds = {(t.dtype, tuple(t.shape)) for t in saved}
    assert (torch.uint8, (96, 64)) in kinds and (torch.float8_e4m3fn, (96, 8)) in kinds
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_dense_linear_does_save_its_weight_sanity():
    # The check above can fail: a plain 16-bit Linear's autograd graph keeps [out, in] weight data.
    lin = nn.Linear(128, 96).to(torch.bfloat16)
    lin.weight.requires_grad_(False)
    saved = []
    x = torch.randn(2, 128, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lin(x)
    assert any(t.is_floating_point() and t.numel() >= 96 * 128 for t in saved)


def test_no_grad_for_frozen_weights_and_input_without_grad():
    lin, q = make(bias=True)
    x = torch.randn(4, 64)
    y = q(x)
    assert not y.requires_grad
    assert all(p.grad is None for p in q.parameters())


def test_autocast_runs_in_autocast_dtype():
    lin, q = make(bias=True, dtype=torch.float32)
    x = torch.randn(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = q(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x.bfloat16(), q.dequantize(torch.bfloat16)) + q.bias.bfloat16())


def test_dtype_casts_keep_quantized_tensors():
    lin, q = make(bias=True, dtype=torch.float32)
    before = [t.clone() for t in q.quantized]
    q.to(torch.bfloat16)
    q.half()
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight_global_scale.dtype == torch.float32
    assert q.weight_packed.dtype == torch.uint8
    assert torch.equal(q.weight_global_scale, before[2])
    assert torch.equal(q.weight_scale.view(torch.uint8), before[1].view(torch.uint8))
    assert q.bias.dtype == torch.float16  # the bias is an ordinary 16-bit tensor and follows casts


def test_state_dict_roundtrip():
    lin, q = make(bias=True, dtype=torch.bfloat16)
    fresh = NVFP4Linear(64, 48, bias=True, dtype=torch.bfloat16)
    fresh.load_state_dict(q.state_dict())
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), q(x))


def test_shared_global_scale_from_linear():
    torch.manual_seed(0)
    a, b = nn.Linear(32, 16, bias=False), nn.Linear(32, 16, bias=False)
    with torch.no_grad():
        b.weight.mul_(5)
    gs = nvfp4.compute_global_scale(a.weight, b.weight)
    qa, qb = NVFP4Linear.from_linear(a, global_scale=gs), NVFP4Linear.from_linear(b, global_scale=gs)
    assert torch.equal(qa.weight_global_scale, qb.weight_global_scale)
    assert torch.equal(qa.weight_global_scale, gs)


def test_dispatch_goes_through_ops(monkeypatch):
    from qerl_trl.nvfp4 import linear as linear_mod

    calls = []

    def spy_fwd(x, *a):
        calls.append("fwd")
        return nvfp4_linear_forward(x, *a)

    def spy_dgrad(dy, *a):
        calls.append("dgrad")
        from qerl_trl.nvfp4.ops import nvfp4_linear_dgrad

        return nvfp4_linear_dgrad(dy, *a)

    monkeypatch.setattr(linear_mod, "nvfp4_linear_forward", spy_fwd)
    monkeypatch.setattr(linear_mod, "nvfp4_linear_dgrad", spy_dgrad)
    _, q = make(bias=False)
    q(torch.randn(2, 64, requires_grad=True)).sum().backward()
    assert calls == ["fwd", "dgrad"]


def test_clear_errors():
    _, q = make(bias=False)
    with pytest.raises(ValueError, match=r"expects input \[\.\.\., 64\]"):
        q(torch.randn(2, 32))
    with pytest.raises(TypeError, match="activations"):
        q(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="divisible by 16"):
        NVFP4Linear(24, 8)
    with pytest.raises(TypeError, match="nn.Linear"):
        NVFP4Linear.from_linear(nn.Conv1d(16, 16, 1))
    with pytest.raises(ValueError, match="divisible by 16"):
        NVFP4Linear.from_linear(nn.Linear(20, 8), name="model.odd.weight")
    bad = nn.Linear(32, 8)
    with torch.no_grad():
        bad.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="model.bad.weight"):
        NVFP4Linear.from_linear(bad, name="model.bad.weight")
    other = nvfp4.quantize(torch.randn(8, 32))
    with pytest.raises(ValueError, match="weight_packed has shape"):
        q.load_quantized(other)
