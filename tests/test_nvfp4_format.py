"""NVFP4 format: bit-identical to compressed-tensors on packed bytes, block scales and global scales.

The reference below runs compressed-tensors' own functions the way llm-compressor produces an NVFP4A16
checkpoint: the memoryless min-max observer's per-group min/max (in the weight's dtype), ``generate_gparam``
on the absmax over the fused group, ``calculate_qparams`` with the NVFP4A16 args, the scale stored in a
parameter of the weight's dtype, then ``NVFP4PackedCompressor.compress`` (``_quantize`` + ``pack_fp4_to_uint8``).
All on CPU.
"""

from __future__ import annotations

import pytest
import torch

from qerl_trl.nvfp4 import format as nvfp4

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import (  # noqa: E402
    pack_fp4_to_uint8,
    unpack_fp4_from_uint8,
)
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.quant_scheme import NVFP4A16  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCHEME = QuantizationScheme(targets=["Linear"], **NVFP4A16)


def ct_quantize(weights: list[torch.Tensor]) -> list[nvfp4.NVFP4Weight]:
    """compressed-tensors / llm-compressor NVFP4A16, with one global scale shared by ``weights``."""
    args = SCHEME.weights
    stats = []
    for w in weights:
        grouped = w.unflatten(-1, (-1, args.group_size)).unsqueeze(0)  # llm-compressor _flatten_weight
        stats.append((torch.amin(grouped, dim=(0, -1)), torch.amax(grouped, dim=(0, -1))))
    # llm-compressor Observer.get_global_scale over a fused group
    absmax = stats[0][1].max()
    for mn, mx in stats:
        absmax = torch.max(absmax, -mn.min())
        absmax = torch.max(absmax, mx.max())
    gs = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    out = []
    for w, (mn, mx) in zip(weights, stats):
        scale, zp = calculate_qparams(mn, mx, args, global_scale=gs)
        scale_param = scale.to(w.dtype)  # the module's weight_scale parameter has the weight's dtype
        sd = {"weight": w, "weight_scale": scale_param, "weight_global_scale": gs, "weight_zero_point": zp}
        comp = NVFP4PackedCompressor.compress(sd, SCHEME)
        out.append(nvfp4.NVFP4Weight(comp["weight_packed"], comp["weight_scale"], comp["weight_global_scale"]))
    return out


def ours(weights: list[torch.Tensor]) -> list[nvfp4.NVFP4Weight]:
    gs = nvfp4.compute_global_scale(*weights)
    return [nvfp4.quantize(w, global_scale=gs) for w in weights]


def assert_bit_identical(a: nvfp4.NVFP4Weight, b: nvfp4.NVFP4Weight) -> None:
    assert a.weight_packed.dtype == b.weight_packed.dtype == torch.uint8
    assert a.weight_scale.dtype == b.weight_scale.dtype == torch.float8_e4m3fn
    assert a.weight_global_scale.dtype == b.weight_global_scale.dtype == torch.float32
    assert a.weight_global_scale.shape == b.weight_global_scale.shape == (1,)
    assert torch.equal(a.weight_global_scale.view(torch.int32), b.weight_global_scale.view(torch.int32))
    assert torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8)), "block scales differ"
    diff = (a.weight_packed != b.weight_packed).nonzero()
    assert diff.numel() == 0, f"{len(diff)} packed bytes differ, first at {diff[:3].tolist()}"


def check(*weights: torch.Tensor) -> None:
    for a, b in zip(ours(list(weights)), ct_quantize(list(weights))):
        assert_bit_identical(a, b)


@pytest.mark.filterwarnings("ignore:.*overflow fp16")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (33, 48), (1, 16), (64, 256)])
def test_random_matches_compressed_tensors(dtype, shape):
    torch.manual_seed(hash((str(dtype), shape)) % 2**31)
    for std in (0.02, 1.0):
        check((torch.randn(shape) * std).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_heavy_tailed_and_outlier(dtype):
    torch.manual_seed(1)
    w = (torch.randn(31, 128) * torch.exp(2 * torch.randn(31, 128))).to(dtype)
    check(w)
    w = (torch.randn(9, 64) * 0.01).to(dtype)
    w[3, 17] = 300.0  # one huge outlier: most block scales become fp8 subnormals or flush to the 0.125 eps
    check(w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_blocks_zero_tensor_and_signed_zero(dtype):
    w = torch.randn(5, 64).to(dtype)
    w[1] = 0
    w[2, 16:32] = 0
    w[3, :16] = -0.0
    w[4, 5] = -0.0
    check(w)
    check(torch.zeros(3, 32, dtype=dtype))  # global scale 1.0, every block scale the 0.125 eps
    check(-torch.zeros(3, 32, dtype=dtype))
    q = nvfp4.quantize(torch.zeros(3, 32, dtype=dtype))
    assert q.weight_global_scale.item() == 1.0
    assert torch.all(q.weight_scale.float() == nvfp4.FP8_SCALE_EPS)
    assert torch.all(q.weight_packed == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_on_e2m1_rounding_boundaries(dtype):
    # Every 16-block starts with 6.0, so the global scale is 2688/6 = 448, every block scale is 448 and
    # scale/global == 1: x/scale == x, and the E2M1 grid points, the midpoints (ties) and their neighbours
    # below land exactly on the rounding boundaries.
    grid = torch.tensor(nvfp4.E2M1_MAGNITUDES)
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, mids + 2**-7, mids - 2**-7, torch.tensor([0.2499, 0.2501, 5.99])])
    vals = torch.cat([vals, -vals])
    n = -(-vals.numel() // 30) * 30  # whole rows of two 16-blocks
    vals = torch.cat([vals, torch.zeros(n - vals.numel())]).reshape(-1, 15)
    w = torch.cat([torch.full((vals.shape[0], 1), 6.0), vals], dim=1).reshape(-1, 32).to(dtype)
    check(w)
    q = nvfp4.quantize(w)
    assert torch.all(q.weight_scale.float() / q.weight_global_scale == 1.0)
    # ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; signs kept
    ties = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2], dtype=dtype)
    ties[0, 8:] *= -1
    got = nvfp4.dequantize(*nvfp4.quantize(ties), dtype=torch.float32)[0]
    assert got[:8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert got[8:].tolist() == [-6.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert torch.signbit(got[9])  # -0.25 rounds to -0, and the sign is kept (code 8), as in compressed-tensors


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_block_scales(dtype):
    # One block at 1.0 sets the global scale; the others are 1e-3 .. 1e-7 of it: fp8 subnormal block scales,
    # and below 2^-10 of the fp8 range they flush to zero and take the 0.125 eps.
    torch.manual_seed(2)
    rows = [torch.randn(64) * s for s in (1.0, 1e-2, 1e-3, 3e-4, 1e-4, 1e-5, 1e-7)]
    w = torch.stack(rows).to(dtype)
    check(w)
    q = nvfp4.quantize(w)
    s = q.weight_scale.float()
    assert (s < 2**-6).any(), "test should exercise fp8 subnormal block scales"
    assert (s == nvfp4.FP8_SCALE_EPS).any() or dtype == torch.float16, "test should exercise the eps path"


def test_small_weights_in_every_dtype():
    torch.manual_seed(3)
    base = torch.randn(16, 64) * 0.01  # amax ~0.03: 2688/amax overflows fp16
    for dtype in DTYPES:
        w = base.to(dtype)
        if dtype == torch.float16:
            with pytest.warns(UserWarning, match="overflow fp16"):
                check(w)
        else:
            check(w)


def test_result_depends_on_dtype_like_compressed_tensors():
    # The same values in fp32 and bf16 give different global scales (2688/amax rounded in the input dtype).
    torch.manual_seed(4)
    w32 = torch.randn(8, 64).to(torch.bfloat16).to(torch.float32)
    g32 = nvfp4.compute_global_scale(w32)
    g16 = nvfp4.compute_global_scale(w32.to(torch.bfloat16))
    assert torch.equal(g32, ct_quantize([w32])[0].weight_global_scale)
    assert torch.equal(g16, ct_quantize([w32.to(torch.bfloat16)])[0].weight_global_scale)
    assert g16.item() == torch.tensor(g16.item()).to(torch.bfloat16).float().item()
    assert g32.item() != g16.item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_global_scale(dtype):
    torch.manual_seed(5)
    q = (torch.randn(32, 64) * 0.1).to(dtype)
    k = (torch.randn(16, 64) * 3).to(dtype)
    v = torch.randn(16, 64).to(dtype)
    check(q, k, v)
    gs = nvfp4.compute_global_scale(q, k, v)
    assert torch.equal(gs, nvfp4.compute_global_scale(k))  # k holds the largest value
    # without sharing, q gets its own (different) global scale
    assert not torch.equal(nvfp4.quantize(q).weight_global_scale, gs)


def test_pack_unpack_nibble_order_matches_compressed_tensors():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3, 2)  # [3, 32], every code in both nibbles
    packed = nvfp4.pack_fp4(codes)
    assert packed[0, 0].item() == 0x10  # even column (code 0) low nibble, odd column (code 1) high nibble
    assert torch.equal(nvfp4.unpack_fp4(packed), codes)
    values = nvfp4.e2m1_lut()[codes.long()]
    ct_values = unpack_fp4_from_uint8(packed, 3, 32, dtype=torch.float32)
    # same values; CT's -0 unpacks as -0.0 too
    assert torch.equal(ct_values, values) and torch.equal(torch.signbit(ct_values), torch.signbit(values))
    assert torch.equal(pack_fp4_to_uint8(values), packed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_matches_compressed_tensors_decompress(dtype):
    torch.manual_seed(6)
    w = torch.randn(12, 64).to(dtype)
    q = nvfp4.quantize(w)
    sd = {"weight_packed": q.weight_packed, "weight_scale": q.weight_scale, "weight_global_scale": q.weight_global_scale}
    ref = NVFP4PackedCompressor.decompress(sd, SCHEME)["weight"]  # bf16, computed in float32 then rounded
    assert torch.equal(nvfp4.dequantize(*q, dtype=torch.bfloat16), ref)
    exact = nvfp4.dequantize(*q, dtype=torch.float32)
    # dequantized values are the E2M1 grid times the block's effective scale
    eff = (q.weight_scale.float() / q.weight_global_scale).repeat_interleave(16, dim=1)
    ratio = (exact / eff).abs()
    nearest = torch.tensor(nvfp4.E2M1_MAGNITUDES)[(ratio.unsqueeze(-1) - torch.tensor(nvfp4.E2M1_MAGNITUDES)).abs().argmin(-1)]
    assert torch.allclose(ratio, nearest, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_names_the_tensor(bad):
    w = torch.randn(4, 32)
    w[2, 3] = bad
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.up_proj\.weight.*non-finite"):
        nvfp4.quantize(w.to(torch.bfloat16), name="model.layers.3.mlp.up_proj.weight")


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="divisible by 16"):
        nvfp4.quantize(torch.randn(4, 24), name="x")
    with pytest.raises(ValueError, match="2-D"):
        nvfp4.quantize(torch.randn(4, 4, 16))
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        nvfp4.quantize(torch.randn(4, 32, dtype=torch.float64))
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        nvfp4.quantize(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="global scale"):
        nvfp4.quantize(torch.randn(4, 32), global_scale=torch.tensor([0.0]))
    q = nvfp4.quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match="weight_scale shape"):
        nvfp4.dequantize(q.weight_packed, q.weight_scale[:, :1], q.weight_global_scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        nvfp4.dequantize(q.weight_packed, q.weight_scale.float(), q.weight_global_scale)


def test_nbytes_is_half_a_byte_per_weight_plus_scales():
    q = nvfp4.quantize(torch.randn(64, 256))
    assert nvfp4.nbytes(q) == 64 * 256 // 2 + 64 * 256 // 16 + 4
