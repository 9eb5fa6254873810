"""NormNoise: realized σ in a bf16 forward, the Ŵ·diag(1+z/w) equivalence on NVFP4, bit-exact restore, seeding."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import tiny_model
from qerl_trl.aqn import NormNoise, find_noise_targets, sample_noise, vllm_param_name
from test_aqn_targets import GATE_UP, QKV, _lora, to_nvfp4

SIGMAS = (5e-4, 2e-3, 1e-2)


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x̂ as transformers' RMSNorm forms it (fp32 math, rounded to the input dtype), as float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).float()


def _effective_scale(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Per-channel scale the norm actually applied to x̂ (least squares over tokens), from its output."""
    with torch.no_grad():
        y = norm(x)
    assert y.dtype == x.dtype, "the next layer must get the activation dtype"
    n = _normalized(x, norm.variance_epsilon)
    return (y.float() * n).sum(0) / n.pow(2).sum(0)


@pytest.fixture(scope="module")
def wide_bf16():
    # hidden 256 x 2 layers x 2 norms = 1024 noise samples: the std estimate is good to ~2%.
    return tiny_model("qwen2", dtype=torch.bfloat16, hidden_size=256, intermediate_size=256, num_attention_heads=4)


@pytest.mark.parametrize("sigma", SIGMAS)
def test_realized_noise_in_bf16_forward_matches_sigma(wide_bf16, sigma):
    noise = NormNoise(wide_bf16)
    x = torch.randn(4096, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    clean = {t.name: _effective_scale(t.module, x) for t in noise.targets}
    z = sample_noise(noise.targets, sigma, seed=3, step=7)
    noise.apply(sigma, seed=3, step=7)
    try:
        realized = {t.name: _effective_scale(t.module, x) - clean[t.name] for t in noise.targets}
    finally:
        noise.restore()
    d = torch.cat(list(realized.values()))
    err = torch.cat([realized[n] - z[n] for n in realized])
    assert abs(d.std().item() / sigma - 1) < 0.10, (d.std().item(), sigma)
    # The realized noise is z itself, not just noise of the right size. What remains is bf16 output rounding:
    # x̂ has 8-bit mantissas, so round(w'·x̂) leaves a per-channel rounding bias of ~1e-4 that moves when w'
    # moves (it is present, and different, in the clean model too); it is a floor that more tokens don't lower.
    assert err.std().item() < 0.3 * sigma
    assert torch.corrcoef(torch.stack([d, torch.cat(list(z.values()))]))[0, 1] > 0.95


def test_naive_bf16_noise_would_round_away(wide_bf16):
    """The control: adding z to the bf16 weights (what fp32 weights avoid) loses most of σ=5e-4."""
    targets = find_noise_targets(wide_bf16)
    z = sample_noise(targets, 5e-4, seed=3, step=7)
    d = torch.cat([(t.module.weight.float() + z[t.name]).to(torch.bfloat16).float() - t.module.weight.float()
                   for t in targets])
    assert d.std().item() < 0.7 * 5e-4 or d.std().item() > 1.3 * 5e-4


def test_zero_sigma_is_bit_identical_and_clean_weights(wide_bf16):
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        ref = wide_bf16(input_ids=ids).logits
    noise = NormNoise(wide_bf16)
    noise.apply(0.0, seed=0, step=0)  # fp32 weights equal to the bf16 ones: same products, same rounding
    with torch.no_grad():
        out = wide_bf16(input_ids=ids).logits
    noise.restore()
    assert torch.equal(out, ref)
    for t, w in zip(noise.targets, noise.clean_weights().values()):
        assert w.dtype == torch.float32 and torch.equal(w, t.module.weight.float())


def _column_scaled(model: nn.Module, z: dict[str, torch.Tensor]) -> nn.Module:
    """Clean norms; q/k/v and gate/up replaced by dense Linear(Ŵ · diag(1 + z/w)) in float32."""
    ref = copy.deepcopy(model)
    for i, layer in enumerate(ref.model.layers):
        for norm, parent, group in (
            (layer.input_layernorm, layer.self_attn, QKV),
            (layer.post_attention_layernorm, layer.mlp, GATE_UP),
        ):
            name = f"model.layers.{i}.{'input_layernorm' if group == QKV else 'post_attention_layernorm'}.weight"
            scale = 1 + z[name] / norm.weight.float()
            for n in group:
                q = getattr(parent, n)
                lin = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None, dtype=torch.float32)
                with torch.no_grad():
                    lin.weight.copy_(q.dequantize(torch.float32) * scale[None, :])
                    if q.bias is not None:
                        lin.bias.copy_(q.bias.float())
                setattr(parent, n, lin)
    return ref


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_noised_norms_equal_column_scaled_fp4_weights(arch):
    model = to_nvfp4(tiny_model(arch, dtype=torch.float32))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    noise = NormNoise(model)
    z = sample_noise(noise.targets, 1e-2, seed=11, step=5)
    with torch.no_grad():
        clean = model(input_ids=ids).logits
        noise.apply(1e-2, seed=11, step=5)
        noised = model(input_ids=ids).logits
        noise.restore()
        scaled = _column_scaled(model, z)(input_ids=ids).logits
    effect = (noised - clean).abs().max().item()
    assert effect > 1e-3  # the noise visibly changes the logits ...
    assert (noised - scaled).abs().max().item() < 1e-3 * effect  # ... exactly as the column scaling does


def _snapshot(model):
    return {n: (p, p.data_ptr(), p.data.clone(), p.dtype) for n, p in model.named_parameters()}


def test_restore_is_bit_exact_and_noise_never_accumulates():
    model = to_nvfp4(tiny_model("llama"))  # bf16 norms
    ids = torch.arange(10).reshape(1, 10)
    before = _snapshot(model)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    noise = NormNoise(model)
    fresh = NormNoise(copy.deepcopy(model))
    for step in (1, 2, 3):
        noise.apply(1e-2, seed=0, step=step)
        expect = fresh.noised_weights(1e-2, seed=0, step=step)  # from a never-noised copy
        for t in noise.targets:
            assert t.module.weight.dtype == torch.float32
            assert torch.equal(t.module.weight.data, expect[t.name])  # clean + z(step), not on top of step-1
        # noised_weights while noise is applied still starts from the clean weights
        assert all(torch.equal(a, b) for a, b in zip(noise.noised_weights(2e-3, 0, 9).values(),
                                                     fresh.noised_weights(2e-3, 0, 9).values()))
        with torch.no_grad():
            assert not torch.equal(model(input_ids=ids).logits, ref)
    noise.restore()
    noise.restore()  # idempotent
    after = dict(model.named_parameters())
    for n, (p, data, values, dtype) in before.items():
        assert after[n] is p and p.data_ptr() == data and p.dtype == dtype and torch.equal(p.data, values), n
    assert all(not t.module._forward_hooks for t in noise.targets)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)


def test_noised_weights_does_not_touch_the_model():
    model = tiny_model("qwen3")
    before = _snapshot(model)
    w = NormNoise(model).noised_weights(1e-2, seed=1, step=2)
    assert all(v.dtype == torch.float32 for v in w.values())
    for n, (p, data, values, dtype) in before.items():
        assert p.data_ptr() == data and p.dtype == dtype and torch.equal(p.data, values)


def test_noise_statistics_and_seeding():
    targets = find_noise_targets(tiny_model("qwen2", hidden_size=512, intermediate_size=128))
    z = sample_noise(targets, 2e-3, seed=0, step=0)
    allz = torch.cat(list(z.values()))
    assert allz.numel() == 4 * 512 and abs(allz.std().item() / 2e-3 - 1) < 0.05 and abs(allz.mean()) < 2e-4
    vecs = list(z.values())
    assert not any(torch.equal(a, b) for i, a in enumerate(vecs) for b in vecs[i + 1:])  # one vector per target
    again = sample_noise(targets, 2e-3, seed=0, step=0)
    assert all(torch.equal(z[k], again[k]) for k in z)
    for other in (sample_noise(targets, 2e-3, seed=1, step=0), sample_noise(targets, 2e-3, seed=0, step=1)):
        assert not any(torch.equal(z[k], other[k]) for k in z)
    # σ only scales: the same standard-normal draw at every σ
    half = sample_noise(targets, 1e-3, seed=0, step=0)
    assert all(torch.allclose(half[k] * 2, z[k], rtol=1e-6, atol=0) for k in z)


def test_same_noise_on_two_ranks_and_through_peft():
    """Rank 0: a plain model; rank 1: another process, different global RNG state, PEFT-wrapped model."""
    rank0 = NormNoise(tiny_model("llama"))
    torch.manual_seed(1234)
    w0 = {vllm_param_name(t): v for t, v in zip(rank0.targets, rank0.noised_weights(1e-2, 5, 40).values())}
    in_process = NormNoise(_lora(tiny_model("llama")))
    w1 = {vllm_param_name(t): v for t, v in zip(in_process.targets, in_process.noised_weights(1e-2, 5, 40).values())}
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)

    tests = Path(__file__).parent
    code = (
        "import sys, json, torch; sys.path.insert(0, %r); torch.manual_seed(99)\n"
        "from conftest import tiny_model\nfrom test_aqn_targets import _lora\n"
        "from qerl_trl.aqn import NormNoise, vllm_param_name\n"
        "n = NormNoise(_lora(tiny_model('llama')))\n"
        "w = n.noised_weights(1e-2, 5, 40)\n"
        "print(json.dumps({vllm_param_name(t): w[t.name].tolist() for t in n.targets}))\n"
    ) % str(tests)
    env = dict(os.environ, PYTHONHASHSEED="77")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    other = json.loads(out.stdout.strip().splitlines()[-1])
    assert other.keys() == w0.keys()
    assert all(torch.equal(torch.tensor(other[k], dtype=torch.float32), w0[k]) for k in w0)


@pytest.mark.parametrize("bad", [dict(sigma=-1e-3), dict(sigma=float("inf")), dict(step=-1), dict(seed=1.5)])
def test_invalid_noise_arguments(bad):
    noise = NormNoise(tiny_model("llama"))
    args = dict(sigma=1e-3, seed=0, step=0) | bad
    with pytest.raises((ValueError, TypeError)):
        noise.apply(**args)
    assert not noise.is_applied
