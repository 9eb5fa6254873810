"""Sampling, applying and restoring AQN's norm-weight noise.

Noise. For every target norm (see :mod:`.targets`) one vector ``z ~ N(0, σ²)`` of size ``hidden`` is drawn
from a CPU ``torch.Generator`` seeded from ``(seed, step, vLLM name of the weight)``: every rank and device,
and the HF and vLLM copies of the model, draw the same noise, a resumed run draws what an uninterrupted run
would, and a target's noise does not depend on which other targets exist. Noise is always added to the clean
weights (never to already-noised ones), so it never accumulates.

Numerics. Norm weights sit near 1.0, where bfloat16 steps are 2⁻⁷ ≈ 0.0078: ``w + z`` rounded to bf16 is
just ``w`` for most channels at σ = 5e-4 (and a coarse 0/±1-ulp staircase at σ = 2e-3), so in a bf16 model
the noise would mostly round away. The noised weights are therefore kept in **float32**: :meth:`NormNoise.apply`
swaps each target's ``weight.data`` for the fp32 tensor ``w_clean.float() + z`` and adds a forward hook on the
norm that casts its output back to the input's dtype. transformers' Llama/Qwen2/Qwen3/Mistral RMSNorm computes
``self.weight * x̂.to(input_dtype)``: with an fp32 weight the product is taken in fp32 and rounded once to
bf16 by the hook, exactly as PyTorch rounds the clean bf16·bf16 product, so the per-channel scale the
projections see is ``w + z`` to fp32 precision (with ``z = 0`` the output is bit-identical to the clean
model). :meth:`NormNoise.noised_weights` returns the same fp32 tensors for the rollout engine (vLLM), which
must use them the same way: multiply in fp32, round the product once to the activation dtype.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from torch import nn

from .targets import NoiseTarget, find_noise_targets, vllm_param_name

__all__ = ["NormNoise", "noise_seed", "sample_noise"]


def noise_seed(seed: int, step: int, key: str) -> int:
    """A 63-bit generator seed from ``(seed, step, key)`` (stable across processes and Python versions)."""
    digest = hashlib.sha256(f"qerl-aqn/{int(seed)}/{int(step)}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _check(sigma: float, seed: int, step: int) -> None:
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"AQN sigma must be a finite number >= 0, got {sigma!r}")
    for name, v in (("seed", seed), ("step", step)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"AQN {name} must be an int, got {v!r}")
    if step < 0:
        raise ValueError(f"AQN step must be >= 0, got {step}")


def sample_noise(targets: Sequence[NoiseTarget], sigma: float, seed: int, step: int) -> dict[str, torch.Tensor]:
    """``{target.name: z}`` with ``z ~ N(0, σ²)`` float32 on CPU, drawn from a generator seeded per target."""
    _check(sigma, seed, step)
    out = {}
    for t in targets:
        g = torch.Generator(device="cpu").manual_seed(noise_seed(seed, step, vllm_param_name(t)))
        out[t.name] = torch.randn(t.hidden_size, generator=g, dtype=torch.float32) * float(sigma)
    return out


def _noised_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _cast_output_to_input_dtype(module: nn.Module, args: tuple, kwargs: dict, output):
    """Forward hook: a norm with an fp32 weight promotes its output; give the next layer the input's dtype."""
    inp = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    if not isinstance(inp, torch.Tensor):
        return None
    if isinstance(output, torch.Tensor):
        return output.to(inp.dtype) if output.dtype != inp.dtype else None
    if isinstance(output, tuple):
        return tuple(o.to(inp.dtype) if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in output)
    return None


class NormNoise:
    """AQN noise for one model: sample, apply in place, restore bit-exactly.

    ``targets`` default to :func:`find_noise_targets(model) <.targets.find_noise_targets>`.
    """

    def __init__(self, model: nn.Module, targets: Sequence[NoiseTarget] | None = None) -> None:
        self.model = model
        self.targets: list[NoiseTarget] = list(targets) if targets is not None else find_noise_targets(model)
        if not self.targets:
            raise ValueError("NormNoise needs at least one target")
        self._clean: dict[str, torch.Tensor] = {}
        self._hooks: list = []
        self.applied: tuple[float, int, int] | None = None  # (sigma, seed, step) of the noise now in the model

    @property
    def is_applied(self) -> bool:
        return self.applied is not None

    def _clean_weight(self, t: NoiseTarget) -> torch.Tensor:
        return self._clean[t.name] if self.is_applied else t.module.weight.data

    def noised_weights(self, sigma: float, seed: int, step: int) -> dict[str, torch.Tensor]:
        """``{target.name: w_clean + z}`` (float32, on the weight's device), without touching the model.

        These are the weights as the forward pass uses them (see the module docstring); with ``sigma=0`` they
        are the clean weights, exactly.
        """
        z = sample_noise(self.targets, sigma, seed, step)
        out = {}
        for t in self.targets:
            w = self._clean_weight(t)
            out[t.name] = w.to(_noised_dtype(w.dtype)) + z[t.name].to(w.device)
        return out

    def clean_weights(self) -> dict[str, torch.Tensor]:
        """``{target.name: w_clean}`` in float32 (what to push to a rollout engine to remove the noise)."""
        return self.noised_weights(0.0, 0, 0)

    @torch.no_grad()
    def apply(self, sigma: float, seed: int, step: int) -> None:
        """Put ``w_clean + z`` (fp32) into the model's target norms; any noise applied before is replaced."""
        noised = self.noised_weights(sigma, seed, step)  # validates, and reads clean copies if applied
        self.restore()
        for t in self.targets:
            p = t.module.weight
            self._clean[t.name] = p.data  # the original tensor itself, untouched until restore puts it back
            if p.dtype != noised[t.name].dtype:
                self._hooks.append(
                    t.module.register_forward_hook(_cast_output_to_input_dtype, with_kwargs=True)
                )
            p.data = noised[t.name]
        self.applied = (float(sigma), int(seed), int(step))

    @torch.no_grad()
    def restore(self) -> None:
        """Put the original weight tensors back (bit-exact: the very tensors apply() swapped out; same Parameters)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for t in self.targets:
            clean = self._clean.pop(t.name, None)
            if clean is not None:
                t.module.weight.data = clean
        self.applied = None
