"""The single-LoRA delta kernels (``qerl_trl.vllm_plugin.lora_kernels``) against the two-GEMM formulation.

On CPU they run under ``TRITON_INTERPRET=1`` (what CI sets); on a GPU the same tests run the compiled kernels, and
the ``gpu`` test below runs Qwen2.5-7B's layer shapes at decode sizes."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import packed_lora

from qerl_trl.vllm_plugin import lora_kernels
from qerl_trl.vllm_plugin.lora_kernels import (
    KERNEL_MAX_ROWS,
    lora_delta_add,
    lora_delta_add_reference,
    lora_slot_bounds,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)


def layer(slot_rows: list[int], k: int, rank: int, dtype: torch.dtype, seed: int = 0):
    return packed_lora(slot_rows, k, rank, dtype, DEVICE, seed)


def check(m: int, slot_rows: list[int], k: int, rank: int, dtype: torch.dtype, x_stride_pad: int = 0,
          variant: str = "split"):
    a, b, bounds = layer(slot_rows, k, rank, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k + x_stride_pad, generator=g).to(DEVICE, dtype)[:, :k]  # maybe a strided view
    y = torch.randn(m, sum(slot_rows), generator=g).to(DEVICE, dtype)
    got = lora_kernels._launch(y, x, a, b, bounds, rank, variant=variant)  # at any row count
    assert not bounds[len(slot_rows) + 1 :].any()  # the serial shrink leaves its semaphores as it found them
    # reference in fp64 from the same (rounded) inputs, with the shrink rounded to the activation dtype as both
    # paths do
    shrunk = (x.double() @ a.double().t()).to(dtype).double()
    want = y.double() + shrunk @ b.double().t()
    assert got.shape == y.shape and got.dtype == y.dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = (got.double() - want).abs().max().item() / (want.abs().max().item() + 1e-9)
    assert err < tol, (m, slot_rows, k, rank, dtype, err)
    return got


@needs_kernel
@pytest.mark.parametrize(
    "m,slot_rows,k,rank",
    [
        (1, [96, 32, 32], 200, 8),  # qkv-like, rank padded to 16, K not a multiple of the K step
        (5, [64, 64], 384, 24),  # gate/up-like, rank not a power of two
        (17, [80], 1000, 32),  # row-parallel-like, one slot; N not a multiple of the column block
        (70, [48, 16, 16], 130, 16),  # two row blocks, slot bounds inside one column block
        (KERNEL_MAX_ROWS, [64], 64, 32),  # the largest size the op sends to the kernels, K below one K step
        (128, [64], 600, 32),  # fewer K splits at more rows
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["split", "serial"])
def test_kernel_path_matches_the_two_gemms(m, slot_rows, k, rank, dtype, variant):
    check(m, slot_rows, k, rank, dtype, variant=variant)


@needs_kernel
def test_strided_and_batched_inputs():
    check(3, [32, 16], 96, 16, torch.float32, x_stride_pad=7)
    a, b, bounds = layer([32], 64, 16, torch.float32)
    x = torch.randn(2, 3, 64, device=DEVICE)
    y = torch.randn(2, 3, 32, device=DEVICE)
    y0 = y.clone()
    got = lora_delta_add(y, x, a, b, bounds, 16)
    torch.testing.assert_close(got, lora_delta_add_reference(y, x, a, b), rtol=1e-4, atol=1e-4)
    assert torch.equal(y, y0)  # the op is functional: y untouched


@needs_kernel
def test_the_op_runs_the_kernels_up_to_kernel_max_rows_and_the_gemms_above(monkeypatch):
    a, b, bounds = layer([32, 16], 48, 8, torch.float32)
    calls = []
    real = lora_kernels._launch
    monkeypatch.setattr(lora_kernels, "_launch", lambda *args: calls.append(args[1].shape[0]) or real(*args))
    for rows in (1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1):
        x, y = torch.randn(rows, 48, device=DEVICE), torch.randn(rows, 48, device=DEVICE)
        torch.testing.assert_close(lora_delta_add(y, x, a, b, bounds, 8), lora_delta_add_reference(y, x, a, b),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
    assert calls == [1, KERNEL_MAX_ROWS]


@needs_kernel
def test_column_major_buffers_are_refused():
    a, b, bounds = layer([32], 64, 16, torch.float32)
    x, y = torch.randn(2, 64, device=DEVICE), torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="row-major"):
        lora_delta_add(y, x, a.t().contiguous().t(), b, bounds, 16)


def test_slot_bounds_are_checked():
    bounds = lora_slot_bounds([0, 96, 128], 160).tolist()
    assert bounds[:4] == [0, 96, 128, 160] and bounds[4:] == [0] * lora_kernels.SEMAPHORES
    with pytest.raises(ValueError, match="rise from 0"):
        lora_slot_bounds([0, 96, 64], 160)


def test_the_op_traces_under_torch_compile():
    """vLLM compiles the model: the op must be opaque to dynamo (a fake implementation, no graph break)."""
    a, b, bounds = layer([16, 8], 32, 8, torch.float32)
    x = torch.randn(KERNEL_MAX_ROWS + 3, 32, device=DEVICE)  # the GEMM path: no Triton inside the compiled call
    y = torch.randn(KERNEL_MAX_ROWS + 3, 24, device=DEVICE)
    fn = torch.compile(lambda y, x: lora_delta_add(y, x, a, b, bounds, 8) * 2, fullgraph=True, backend="eager")
    torch.testing.assert_close(fn(y, x), 2 * lora_delta_add_reference(y, x, a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 64, 128])
@pytest.mark.parametrize("variant", ["split", "serial"])
def test_qwen25_7b_layer_shapes_on_the_gpu(m, variant):
    # qkv (q 3584, k/v 512), o, gate/up (18944 each), down at r=32, bf16 as vLLM serves them
    for slot_rows, k in (([3584, 512, 512], 3584), ([3584], 3584), ([18944, 18944], 3584), ([3584], 18944)):
        check(m, slot_rows, k, 32, torch.bfloat16, variant=variant)


@pytest.mark.gpu
def test_the_kernels_compile_under_a_serializing_jit_hook(monkeypatch):
    """vLLM's worker installs a Triton JIT hook after its warm-up (``vllm/triton_utils/jit_monitor.py``, 0.24), and
    Triton then JSON-serializes every later compile's constexprs: a decode size first seen after warm-up compiles
    under it. Every kernel must compile there and stay right."""
    import json

    from triton import knobs

    seen: list[str] = []

    def before(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        json.loads(compile["specialization_data"])
        return False

    def after(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # once per compile
        json.loads(compile["specialization_data"])
        seen.append(fn.name)
        return False

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", before)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", after)
    names = ("_lora_shrink_kernel", "_lora_expand_kernel")
    for name in names:
        getattr(lora_kernels, name).device_caches.clear()
    for launch in (lora_kernels._shrink_launch, lora_kernels._expand_launch):
        launch.clear()
    check(3, [96, 32, 32], 512, 32, torch.bfloat16, variant="split")
    check(3, [96, 32, 32], 512, 32, torch.bfloat16, variant="serial")
    assert [n for n in seen if n in names] == [*names, *names]  # each kernel compiled once per variant


def _spy_on_variants(monkeypatch) -> list[str]:
    """The variant of every shrink launched from now on ("split" / "serial"), read from its SERIAL constexpr."""
    used: list[str] = []
    real = lora_kernels._shrink_launch
    monkeypatch.setattr(lora_kernels, "_shrink_launch",
                        lambda grid, args, config, constexprs: used.append("serial" if constexprs["SERIAL"] else "split")
                        or real(grid, args, config, constexprs))  # fmt: skip
    return used


@needs_kernel
def test_wide_outputs_take_the_serial_shrink(monkeypatch):
    """gate/up-wide layers run the serial shrink (one finished ``x A^T``, a light expand); narrow ones the split
    pair. Either way the layer's semaphores end at zero."""
    monkeypatch.setattr(lora_kernels, "SERIAL_MIN_COLS", 40)
    used = _spy_on_variants(monkeypatch)
    for slot_rows in ([16, 16], [24, 24]):
        a, b, bounds = layer(slot_rows, 48, 8, torch.float32)
        x, y = torch.randn(3, 48, device=DEVICE), torch.randn(3, sum(slot_rows), device=DEVICE)
        torch.testing.assert_close(lora_delta_add(y, x, a, b, bounds, 8), lora_delta_add_reference(y, x, a, b),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        assert not bounds[3:].any()
    assert used == ["split", "serial"]


@needs_kernel
def test_a_layer_without_semaphores_enough_takes_the_split_pair(monkeypatch):
    """A LoRA rank too large for the layer's semaphores (here a bounds buffer cut to one) falls back to the split
    pair instead of failing inside the engine."""
    monkeypatch.setattr(lora_kernels, "SERIAL_MIN_COLS", 40)
    used = _spy_on_variants(monkeypatch)
    a, b, bounds = layer([24, 24], 48, 32, torch.float32)  # two LoRA-row blocks of 32: two semaphores needed
    x, y = torch.randn(2, 48, device=DEVICE), torch.randn(2, 48, device=DEVICE)
    torch.testing.assert_close(lora_delta_add(y, x, a, b, bounds[:4], 32), lora_delta_add_reference(y, x, a, b),
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    assert used == ["split"]
