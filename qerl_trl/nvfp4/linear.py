"""``NVFP4Linear``: a frozen Linear that holds only its NVFP4 tensors (and an optional 16-bit bias)."""

from __future__ import annotations

import torch
from torch import nn

from . import format as nvfp4
from .ops import nvfp4_linear_dgrad, nvfp4_linear_forward


class _NVFP4LinearFn(torch.autograd.Function):
    """Saves the packed tensors, not a dequantized weight; backward dequantizes again for the input grad."""

    @staticmethod
    def forward(ctx, x, packed, scale, global_scale):
        ctx.save_for_backward(packed, scale, global_scale)
        return nvfp4_linear_forward(x, packed, scale, global_scale)

    @staticmethod
    def backward(ctx, dy):
        packed, scale, global_scale = ctx.saved_tensors
        dx = nvfp4_linear_dgrad(dy.to(dy.dtype), packed, scale, global_scale) if ctx.needs_input_grad[0] else None
        return dx, None, None, None


class NVFP4Linear(nn.Module):
    """A frozen NVFP4 linear layer: ``y = x @ Ŵᵀ + b``.

    State (names as in a compressed-tensors checkpoint): ``weight_packed`` uint8 [out, in/2],
    ``weight_scale`` float8_e4m3fn [out, in/16], ``weight_global_scale`` float32 [1], and ``bias``
    (16-bit, optional). All are frozen parameters (``requires_grad=False``), so device moves, state dicts
    and transformers' loaders treat them like any weight; only adapters on top (LoRA) are trained.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        if in_features % nvfp4.BLOCK_SIZE:
            raise ValueError(f"NVFP4Linear needs in_features divisible by {nvfp4.BLOCK_SIZE}, got {in_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = dtype
        frozen = dict(requires_grad=False)
        self.weight_packed = nn.Parameter(
            torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device), **frozen
        )
        self.weight_scale = nn.Parameter(
            torch.zeros(out_features, in_features // nvfp4.BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device),
            **frozen,
        )
        self.weight_global_scale = nn.Parameter(torch.ones(1, dtype=torch.float32, device=device), **frozen)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), **frozen)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, global_scale: torch.Tensor | None = None, name: str = "weight"
    ) -> "NVFP4Linear":
        """Quantize an ``nn.Linear`` (its weight may be shared-global-scale with siblings via ``global_scale``)."""
        w = linear.weight.data
        q = nvfp4.quantize(w, global_scale=global_scale, name=name)
        dtype = w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta", dtype=dtype)
        mod.load_quantized(q, bias=None if linear.bias is None else linear.bias.data.to(dtype))
        return mod

    def load_quantized(self, q: nvfp4.NVFP4Weight, bias: torch.Tensor | None = None) -> None:
        self.weight_packed = nn.Parameter(q.weight_packed, requires_grad=False)
        self.weight_scale = nn.Parameter(q.weight_scale, requires_grad=False)
        self.weight_global_scale = nn.Parameter(q.weight_global_scale.reshape(1), requires_grad=False)
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=False)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight Ŵ (for checks, merging and export; never used by forward)."""
        return nvfp4.dequantize(
            self.weight_packed, self.weight_scale, self.weight_global_scale, dtype or self.compute_dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"NVFP4Linear takes bf16/fp16/fp32 activations, got {x.dtype}")
        y = _NVFP4LinearFn.apply(x, self.weight_packed, self.weight_scale, self.weight_global_scale)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, format=nvfp4"
