"""``NVFP4Linear``: a frozen Linear that holds only its NVFP4 tensors (and an optional 16-bit bias)."""

from __future__ import annotations

import torch
from torch import nn

from . import format as nvfp4
from .ops import nvfp4_linear_dgrad, nvfp4_linear_forward

#: the frozen quantized tensors, named as in a compressed-tensors checkpoint; their dtypes never change
QUANTIZED_PARAMS = ("weight_packed", "weight_scale", "weight_global_scale")
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class _NVFP4LinearFn(torch.autograd.Function):
    """``y = x @ Ŵᵀ``. Saves the packed tensors, never a dequantized weight; backward dequantizes again.

    The base weight is frozen, so backward returns only the input gradient (what LoRA layers below need).
    """

    @staticmethod
    def forward(ctx, x, packed, scale, global_scale):
        ctx.save_for_backward(packed, scale, global_scale)
        return nvfp4_linear_forward(x, packed, scale, global_scale)

    @staticmethod
    def backward(ctx, dy):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        packed, scale, global_scale = ctx.saved_tensors
        return nvfp4_linear_dgrad(dy, packed, scale, global_scale), None, None, None


class NVFP4Linear(nn.Module):
    """A frozen NVFP4 linear layer: ``y = x @ Ŵᵀ + b``, ``Ŵ = e2m1 * weight_scale / weight_global_scale``.

    State (names as in a compressed-tensors checkpoint): ``weight_packed`` uint8 [out, in/2],
    ``weight_scale`` float8_e4m3fn [out, in/16], ``weight_global_scale`` float32 [1], and ``bias``
    (``dtype``, optional). All are frozen parameters (``requires_grad=False``), so device moves, state dicts
    and transformers' loaders treat them like any weight; only adapters on top (LoRA) are trained.

    ``model.to(torch.bfloat16)`` / ``.half()`` move these tensors but never change their dtypes (a float8
    scale or the float32 global scale cast to 16 bits would corrupt the weight); the bias follows the cast.

    Activations may be bf16/fp16/fp32; the output has the activation's dtype (under ``torch.autocast`` the
    autocast dtype, as for ``nn.Linear``). The matmul goes through :mod:`qerl_trl.nvfp4.ops`, which picks a
    fast kernel when one is registered for the call and the dequantize-then-matmul reference otherwise.
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
        if in_features <= 0 or out_features <= 0 or in_features % nvfp4.BLOCK_SIZE:
            raise ValueError(
                f"NVFP4Linear needs in_features divisible by {nvfp4.BLOCK_SIZE} (and both sizes positive), got "
                f"in_features={in_features}, out_features={out_features}; keep such a layer in 16-bit"
            )
        if dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"NVFP4Linear dtype (bias and default compute dtype) must be bf16/fp16/fp32, got {dtype}")
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = dtype
        self.weight_packed = nn.Parameter(
            torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.zeros(out_features, in_features // nvfp4.BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device),
            requires_grad=False,
        )
        self.weight_global_scale = nn.Parameter(
            torch.ones(1, dtype=torch.float32, device=device), requires_grad=False
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, global_scale: torch.Tensor | None = None, name: str = "weight"
    ) -> "NVFP4Linear":
        """Quantize an ``nn.Linear`` (bit-identical to compressed-tensors; see :func:`~qerl_trl.nvfp4.quantize`).

        ``global_scale`` shares one per-tensor scale with sibling layers (q/k/v, gate/up): compute it with
        :func:`~qerl_trl.nvfp4.compute_global_scale` over all their weights. ``name`` appears in errors.
        The bias and the compute dtype keep the Linear's dtype.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear, got {type(linear).__name__} for {name}")
        w = linear.weight.detach()
        q = nvfp4.quantize(w, global_scale=global_scale, name=name)
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta", dtype=w.dtype)
        mod.load_quantized(q, bias=None if linear.bias is None else linear.bias.detach().clone())
        return mod

    def load_quantized(self, q: nvfp4.NVFP4Weight, bias: torch.Tensor | None = None) -> None:
        """Install quantized tensors (e.g. from a checkpoint), checking dtypes and shapes against this layer."""
        nvfp4.check_packed(*q, name=f"NVFP4Linear({self.in_features}->{self.out_features})")
        if tuple(q.weight_packed.shape) != (self.out_features, self.in_features // 2):
            raise ValueError(
                f"weight_packed has shape {tuple(q.weight_packed.shape)}, expected "
                f"{(self.out_features, self.in_features // 2)} for in_features={self.in_features}, "
                f"out_features={self.out_features}"
            )
        self.weight_packed = nn.Parameter(q.weight_packed, requires_grad=False)
        self.weight_scale = nn.Parameter(q.weight_scale, requires_grad=False)
        self.weight_global_scale = nn.Parameter(q.weight_global_scale.reshape(1), requires_grad=False)
        if bias is not None:
            if tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({self.out_features},)")
            self.bias = nn.Parameter(bias.to(self.compute_dtype), requires_grad=False)

    @property
    def quantized(self) -> nvfp4.NVFP4Weight:
        return nvfp4.NVFP4Weight(self.weight_packed, self.weight_scale, self.weight_global_scale)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight Ŵ (for checks, merging and export; never used by forward or kept for backward)."""
        return nvfp4.dequantize(
            self.weight_packed, self.weight_scale, self.weight_global_scale, dtype or self.compute_dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[-1] != self.in_features:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"NVFP4Linear expects input [..., {self.in_features}], got {shape}")
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if x.dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"NVFP4Linear takes bf16/fp16/fp32 activations, got {x.dtype}")
        if x.device != self.weight_packed.device:
            raise RuntimeError(
                f"NVFP4Linear input is on {x.device} but its weights are on {self.weight_packed.device}; "
                "move the model or the input"
            )
        if x.requires_grad and torch.is_grad_enabled():
            y = _NVFP4LinearFn.apply(x, self.weight_packed, self.weight_scale, self.weight_global_scale)
        else:  # nothing to differentiate (rollout log-probs, eval): skip autograd.Function's per-call cost
            y = nvfp4_linear_forward(x, self.weight_packed, self.weight_scale, self.weight_global_scale)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _apply(self, fn, recurse: bool = True):
        # Keep the quantized tensors' dtypes through .to(dtype)/.half()/.bfloat16(): follow device moves only.
        before = {n: getattr(self, n).data for n in QUANTIZED_PARAMS}
        out = super()._apply(fn, recurse)
        for n, old in before.items():
            p = getattr(self, n)
            if p.dtype != old.dtype:
                p.data = old.to(p.device)
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            "format=nvfp4"
        )
