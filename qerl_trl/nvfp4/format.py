"""The NVFP4 weight format, as plain torch functions (no Hugging Face imports).

NVFP4 stores a weight ``W [out, in]`` as

* ``weight_packed``  uint8 ``[out, in/2]``: E2M1 codes, two per byte, the even column in the low nibble;
* ``weight_scale``   float8_e4m3fn ``[out, in/16]``: one scale per block of 16 consecutive inputs;
* ``weight_global_scale`` float32 ``[1]``: ``448 * 6 / amax(W)``, so block scales use FP8's whole range.

``dequant = e2m1(code) * scale / global_scale``. This is the compressed-tensors ``nvfp4-pack-quantized``
layout that vLLM serves, and the rounding here reproduces compressed-tensors bit for bit
(``tests/test_nvfp4_format.py`` checks that against the library itself).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK_SIZE = 16
FP4_E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0
#: fp8 value that replaces an all-zero block's scale (compressed-tensors' eps for float8_e4m3fn)
FP8_SCALE_EPS = 0.125
#: magnitude of each E2M1 code 0..7; codes 8..15 are the same magnitudes negated
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class NVFP4Weight(NamedTuple):
    """The three tensors of one NVFP4 weight, named as in a compressed-tensors checkpoint."""

    weight_packed: torch.Tensor  # uint8 [out, in/2]
    weight_scale: torch.Tensor  # float8_e4m3fn [out, in/16]
    weight_global_scale: torch.Tensor  # float32 [1]


def e2m1_lut(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 16-entry table from E2M1 code (sign in bit 3) to its value."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat([mags, -mags]).to(device=device, dtype=dtype)


def check_finite(weight: torch.Tensor, name: str = "weight") -> None:
    """Raise a ValueError naming ``name`` if ``weight`` holds NaN or Inf (they would poison every scale)."""
    if not torch.isfinite(weight).all():
        bad = (~torch.isfinite(weight)).sum().item()
        raise ValueError(
            f"cannot quantize {name} to NVFP4: it holds {bad} non-finite value(s) (NaN or Inf). "
            "Fix or re-export the checkpoint; quantizing would corrupt the whole tensor's scales."
        )


def compute_global_scale(*tensors: torch.Tensor) -> torch.Tensor:
    """``448 * 6 / amax`` over all ``tensors`` (float32 ``[1]``).

    Pass several tensors (q/k/v, or gate/up) to give them one shared global scale, which vLLM needs to fuse
    them. An all-zero input gets global scale 1.0 rather than inf.
    """
    amax = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    for t in tensors:
        amax = torch.maximum(amax, t.detach().abs().amax().to(torch.float32))
    amax = torch.clamp(amax, min=torch.finfo(torch.float32).tiny)
    gs = FP8_E4M3_MAX * FP4_E2M1_MAX / amax
    gs = torch.where(torch.isfinite(gs), gs, torch.ones_like(gs))
    return gs.reshape(1).to(torch.float32)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round scaled values to E2M1 codes (uint8 in 0..15), ties as compressed-tensors breaks them.

    Thresholds (on |x|): <=0.25 -> 0, <0.75 -> 0.5, <=1.25 -> 1, <1.75 -> 1.5, <=2.5 -> 2, <3.5 -> 3,
    <=5 -> 4, else 6 (round half to even on the E2M1 grid). The sign bit is set for negative inputs,
    including those that round to zero (compressed-tensors keeps that -0).
    """
    a = x.abs()
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    sign = torch.signbit(x).to(torch.uint8) << 3
    return code | sign


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes ``[..., n]`` (n even) into ``[..., n/2]`` bytes, even column in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even number of columns, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: ``[..., n/2]`` bytes to ``[..., n]`` codes."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def _check_shape(weight: torch.Tensor, name: str) -> None:
    if weight.ndim != 2:
        raise ValueError(f"NVFP4 quantizes 2-D weights; {name} has shape {tuple(weight.shape)}")
    if weight.shape[1] % BLOCK_SIZE:
        raise ValueError(
            f"NVFP4 needs in_features divisible by {BLOCK_SIZE}; {name} has shape {tuple(weight.shape)}. "
            "Keep this module in 16-bit (modules_to_not_convert)."
        )
    if not weight.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {weight.dtype}")


def quantize(
    weight: torch.Tensor, global_scale: torch.Tensor | None = None, name: str = "weight"
) -> NVFP4Weight:
    """Round-to-nearest NVFP4 quantization of a 2-D weight ``[out, in]``.

    ``global_scale`` shares one per-tensor scale across a group (q/k/v, gate/up); by default it is computed
    from ``weight`` alone. Works for bf16/fp16/fp32 input on any device; the math runs in float32.
    """
    _check_shape(weight, name)
    check_finite(weight, name)
    if global_scale is None:
        global_scale = compute_global_scale(weight)
    global_scale = global_scale.to(device=weight.device, dtype=torch.float32).reshape(1)
    out_f, in_f = weight.shape
    w = weight.detach().to(torch.float32).reshape(out_f, in_f // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = w.abs().amax(dim=-1)
    scale = global_scale * (block_amax / FP4_E2M1_MAX)
    scale = torch.clamp(scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    scale = torch.where(
        scale.to(torch.float32) == 0, torch.tensor(FP8_SCALE_EPS, device=w.device), scale.to(torch.float32)
    ).to(torch.float8_e4m3fn)
    eff = scale.to(torch.float32) / global_scale
    scaled = w / eff.unsqueeze(-1)
    scaled = torch.clamp(scaled, -FP4_E2M1_MAX, FP4_E2M1_MAX)
    codes = round_to_e2m1(scaled).reshape(out_f, in_f)
    return NVFP4Weight(pack_fp4(codes), scale, global_scale.clone())


def dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``e2m1(code) * scale / global_scale`` as a dense ``[out, in]`` tensor of ``dtype``.

    Computed in float32 and rounded once to ``dtype``: this is the reference every kernel is checked against.
    """
    codes = unpack_fp4(weight_packed)
    out_f, in_f = codes.shape
    vals = e2m1_lut(codes.device)[codes.long()]
    eff = weight_scale.to(torch.float32) / weight_global_scale.to(torch.float32)
    w = vals.reshape(out_f, in_f // BLOCK_SIZE, BLOCK_SIZE) * eff.unsqueeze(-1)
    return w.reshape(out_f, in_f).to(dtype)


def nbytes(q: NVFP4Weight) -> int:
    """Resident bytes of one quantized weight (packed codes + block scales + global scale)."""
    return sum(t.numel() * t.element_size() for t in q)
