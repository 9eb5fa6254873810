"""The NVFP4 weight format, as plain torch functions (no Hugging Face imports).

NVFP4 stores a weight ``W [out, in]`` as

* ``weight_packed``  uint8 ``[out, in/2]``: E2M1 codes, two per byte, the even column in the low nibble;
* ``weight_scale``   float8_e4m3fn ``[out, in/16]``: one scale per block of 16 consecutive inputs;
* ``weight_global_scale`` float32 ``[1]``: ``448 * 6 / amax(W)``, so block scales use FP8's whole range.

``dequant = e2m1(code) * scale / global_scale``. This is the compressed-tensors ``nvfp4-pack-quantized``
layout that vLLM serves, and the rounding here reproduces compressed-tensors bit for bit
(``tests/test_nvfp4_format.py`` checks that against the library itself).

Matching compressed-tensors means matching its dtypes too: the amax and ``amax / 6`` (block scale) and
``2688 / amax`` (global scale) run in the *weight's* dtype, so one float32 weight and its bf16 copy can get
different bytes. We reproduce that for bf16, fp16 and fp32 inputs and refuse other dtypes.
"""

from __future__ import annotations

import warnings
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


#: dtypes whose rounding we reproduce exactly (compressed-tensors does part of its math in the weight's dtype)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _common_dtype(tensors: tuple[torch.Tensor, ...], name: str) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"NVFP4 quantizes bf16/fp16/fp32 weights; {name} is {dtype}. Cast it to bfloat16 (or float32) first."
        )
    return dtype


def compute_global_scale(*tensors: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """``448 * 6 / amax`` over all ``tensors``, as float32 ``[1]``, rounded exactly like compressed-tensors.

    Pass several tensors (q/k/v, or gate/up) to give them one shared global scale, which vLLM needs to fuse
    them. Like llm-compressor's min-max observer + ``generate_gparam``, the amax and the division run in the
    weights' own dtype (bf16 weights get a bf16-rounded global scale, stored as float32), and a result that is
    not finite becomes 1.0: an all-zero tensor, and also an fp16 tensor with amax below ~0.041 (2688/amax
    overflows fp16), which then loses block-scale precision. We warn in that second case; load such models in
    bf16 or fp32 instead.
    """
    if not tensors:
        raise ValueError("compute_global_scale needs at least one tensor")
    dtype = _common_dtype(tensors, name)
    device = tensors[0].device
    amax = torch.zeros(1, dtype=dtype, device=device)
    for t in tensors:
        if t.numel() == 0:
            raise ValueError(f"cannot quantize {name}: it is empty (shape {tuple(t.shape)})")
        amax = torch.maximum(amax, t.detach().abs().amax().to(device=device, dtype=dtype).reshape(1))
    amax = torch.clamp(amax, min=torch.finfo(dtype).tiny)
    # The same expression as compressed-tensors: python-float / tensor (torch computes reciprocal() * 2688).
    gs = FP8_E4M3_MAX * FP4_E2M1_MAX / amax
    if dtype == torch.float16 and bool(torch.isinf(gs).any()) and bool((amax > torch.finfo(dtype).tiny).any()):
        warnings.warn(
            f"{name}: fp16 amax {amax.item():.3g} makes 2688/amax overflow fp16, so (as in compressed-tensors) the "
            "global scale falls back to 1.0 and small block scales lose precision. Load the model in bf16 instead.",
            stacklevel=2,
        )
    gs = torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)
    return gs.to(torch.float32).reshape(1)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round scaled values (already clamped to [-6, 6]) to E2M1 codes (uint8 0..15) as compressed-tensors does.

    Thresholds (on |x|): <=0.25 -> 0, <0.75 -> 0.5, <=1.25 -> 1, <1.75 -> 1.5, <=2.5 -> 2, <3.5 -> 3,
    <=5 -> 4, else 6 (ties go to the even E2M1 code). The sign bit is set for every ``x < 0``, including values
    that round to zero (compressed-tensors keeps that -0), but not for an input of -0.0 (``torch.sign(-0.0)``
    is 0 in its ``cast_to_fp4``, and its Triton kernel tests ``x < 0``).
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
    sign = (x < 0).to(torch.uint8) << 3
    return code | sign


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes ``[..., n]`` (n even) into ``[..., n/2]`` bytes, even column in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even number of columns, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: ``[..., n/2]`` bytes to ``[..., n]`` codes."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp4 takes uint8 packed codes, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def _check_weight(weight: torch.Tensor, name: str) -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    if weight.ndim != 2:
        raise ValueError(f"NVFP4 quantizes 2-D weights; {name} has shape {tuple(weight.shape)}")
    if weight.shape[1] % BLOCK_SIZE or weight.shape[1] == 0 or weight.shape[0] == 0:
        raise ValueError(
            f"NVFP4 needs a non-empty weight with in_features divisible by {BLOCK_SIZE}; {name} has shape "
            f"{tuple(weight.shape)}. Keep this module in 16-bit (modules_to_not_convert)."
        )
    if weight.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"NVFP4 quantizes bf16/fp16/fp32 weights; {name} is {weight.dtype}. Cast it to bfloat16 first."
        )


def quantize(
    weight: torch.Tensor, global_scale: torch.Tensor | None = None, name: str = "weight"
) -> NVFP4Weight:
    """Round-to-nearest NVFP4 quantization of a 2-D weight ``[out, in]``, bit-identical to compressed-tensors.

    ``global_scale`` shares one per-tensor scale across a group (q/k/v, gate/up; make it with
    :func:`compute_global_scale` over all of them); by default it is computed from ``weight`` alone.

    The steps and their dtypes follow llm-compressor's min-max observer, compressed-tensors'
    ``calculate_qparams`` and its NVFP4 compressor (checked against both in ``tests/test_nvfp4_format.py``):
    block amax and ``amax / 6`` in the weight's dtype; ``global * that`` in float32, clamped to +-448 and
    rounded to FP8-E4M3; a zero block scale replaced by 0.125; then ``x / (scale / global)`` in float32,
    clamped to +-6 and rounded to E2M1 (:func:`round_to_e2m1`). Non-finite weights raise a ValueError naming
    ``name``.
    """
    _check_weight(weight, name)
    check_finite(weight, name)
    if global_scale is None:
        global_scale = compute_global_scale(weight, name=name)
    global_scale = torch.as_tensor(global_scale).to(device=weight.device, dtype=torch.float32).reshape(1)
    if not bool(torch.isfinite(global_scale).all()) or not bool((global_scale > 0).all()):
        raise ValueError(f"global scale for {name} must be finite and positive, got {global_scale.item()}")
    blocks = weight.detach().reshape(weight.shape[0], -1, BLOCK_SIZE)
    # block scale: amax/6 rounded in the weight dtype, then global * it in float32 (then FP8, in _round_blocks)
    codes, scale = _round_blocks(blocks, global_scale * (blocks.abs().amax(dim=-1) / FP4_E2M1_MAX), global_scale)
    return NVFP4Weight(pack_fp4(codes), scale, global_scale.clone())


def _round_blocks(blocks: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """E2M1 codes ``[out, in]`` and FP8 block scales of ``blocks [out, in/16, 16]``, given each block's wanted scale
    (``global * amax / 6``) and the global scale (``[1]``, or ``[out, 1]``: one per row): the scale clamped to
    +-448 and rounded to FP8 (a zero one replaced by 0.125), then ``x / (scale / global)`` in float32, clamped to
    +-6 and rounded to E2M1. :func:`quantize` and :func:`quantize_rows` share it."""
    scale = torch.clamp(scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    scale = torch.where(scale == 0, torch.full_like(scale, FP8_SCALE_EPS), scale)
    eff = scale / global_scale
    scaled = torch.clamp(blocks.to(torch.float32) / eff.unsqueeze(-1), -FP4_E2M1_MAX, FP4_E2M1_MAX)
    return round_to_e2m1(scaled).reshape(blocks.shape[0], -1), scale.to(torch.float8_e4m3fn)


def quantize_rows(weight: torch.Tensor, row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 of ``weight [out, in]`` against a given second scale per row: ``(packed uint8 [out, in/2], block scales
    float8_e4m3fn [out, in/16], saturated)``, whose dequantization is ``e2m1(code) * scale * row_scale[row]``.

    Why: the expand-in-GEMM path appends the LoRA's B to a linear's NVFP4 weight as extra input columns, and those
    must share the second scale Humming already holds for each row (``1 / weight_global_scale`` of the row's shard),
    so only the block scales are free. Round to nearest as :func:`quantize`, in float32 throughout (nothing here has
    to match a checkpoint's bytes). ``saturated`` (bool, 0-dim, on the device, no host sync): some block needed a
    scale above FP8's 448, so its values were clipped: B outgrew the base weight's range."""
    out_f, in_f = weight.shape
    if in_f % BLOCK_SIZE:
        raise ValueError(f"quantize_rows needs in_features divisible by {BLOCK_SIZE}, got {tuple(weight.shape)}")
    global_rows = 1.0 / row_scale.to(device=weight.device, dtype=torch.float32).reshape(out_f, 1)
    blocks = weight.detach().to(torch.float32).reshape(out_f, in_f // BLOCK_SIZE, BLOCK_SIZE)
    want = global_rows * (blocks.abs().amax(dim=-1) / FP4_E2M1_MAX)
    codes, scale = _round_blocks(blocks, want, global_rows)
    return pack_fp4(codes), scale, (want > FP8_E4M3_MAX).any()


def dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``e2m1(code) * scale / global_scale`` as a dense ``[out, in]`` tensor of ``dtype``.

    Computed in float32 and rounded once to ``dtype``, as compressed-tensors' decompressor does: this is the
    reference every kernel is checked against.
    """
    check_packed(weight_packed, weight_scale, weight_global_scale)
    codes = unpack_fp4(weight_packed)
    out_f, in_f = codes.shape
    vals = e2m1_lut(codes.device)[codes.long()]
    eff = weight_scale.to(torch.float32) / weight_global_scale.to(torch.float32)
    w = vals.reshape(out_f, in_f // BLOCK_SIZE, BLOCK_SIZE) * eff.unsqueeze(-1)
    return w.reshape(out_f, in_f).to(dtype)


def check_packed(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor, name: str = "weight"
) -> None:
    """Raise a clear error unless the three tensors form one NVFP4 weight (dtypes and shapes)."""
    problems = []
    if weight_packed.dtype != torch.uint8 or weight_packed.ndim != 2:
        problems.append(f"weight_packed must be 2-D uint8, got {weight_packed.dtype} {tuple(weight_packed.shape)}")
    if weight_scale.dtype != torch.float8_e4m3fn or weight_scale.ndim != 2:
        problems.append(f"weight_scale must be 2-D float8_e4m3fn, got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    elif weight_packed.ndim == 2 and tuple(weight_scale.shape) != (
        weight_packed.shape[0],
        weight_packed.shape[1] * 2 // BLOCK_SIZE,
    ):
        problems.append(
            f"weight_scale shape {tuple(weight_scale.shape)} does not fit weight_packed {tuple(weight_packed.shape)} "
            f"(expected [out, in/{BLOCK_SIZE}])"
        )
    if weight_packed.ndim == 2 and (weight_packed.shape[1] * 2) % BLOCK_SIZE:
        problems.append(f"in_features {weight_packed.shape[1] * 2} is not a multiple of {BLOCK_SIZE}")
    if weight_global_scale.dtype != torch.float32 or weight_global_scale.numel() != 1:
        problems.append(
            f"weight_global_scale must be one float32 value, got {weight_global_scale.dtype} "
            f"{tuple(weight_global_scale.shape)}"
        )
    if problems:
        raise ValueError(f"{name} is not a valid NVFP4 weight: " + "; ".join(problems))


def nbytes(q: NVFP4Weight) -> int:
    """Resident bytes of one quantized weight (packed codes + block scales + global scale)."""
    return sum(t.numel() * t.element_size() for t in q)
