"""The single-LoRA delta (``qerl_trl.vllm_plugin.lora_kernels``: the shrink, then the in-place expand) against the
two-GEMM formulation.

On CPU they run under ``TRITON_INTERPRET=1`` (what CI sets); on a GPU the same tests run the compiled kernels, and
the ``gpu`` tests run Qwen2.5-7B's layer shapes at decode sizes, also inside a CUDA graph with a GEMM between the
two ops, as vLLM runs them."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import packed_lora

from qerl_trl.vllm_plugin import lora_kernels
from qerl_trl.vllm_plugin.lora_kernels import (
    KERNEL_MAX_ROWS,
    lora_delta_add_reference,
    lora_expand_,
    lora_partials,
    lora_shrink,
    lora_slot_bounds,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)


def layer(slot_rows: list[int], k: int, rank: int, dtype: torch.dtype, seed: int = 0):
    """``(a, b, bounds, partials)`` of one single-LoRA layer."""
    a, b, bounds = packed_lora(slot_rows, k, rank, dtype, DEVICE, seed)
    return a, b, bounds, lora_partials(a.shape[0], DEVICE)


def delta_add(y, x, a, b, bounds, partials, rank, between=None):
    """``y + (x A^T) B^T`` as the layer runs it (``between``: the base GEMM's stand-in, between the two ops)."""
    y = y.clone()
    shrunk = lora_shrink(x, a, bounds, partials, rank, y.shape[-1])
    if between is not None:
        between()
    lora_expand_(y, shrunk, b, bounds, partials, rank, x.shape[-1])
    return y


def check(m: int, slot_rows: list[int], k: int, rank: int, dtype: torch.dtype, x_stride_pad: int = 0):
    """The pair ``_serial`` picks for this shape (tests pin the other with ``SERIAL_MIN_COLS``)."""
    a, b, bounds, partials = layer(slot_rows, k, rank, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k + x_stride_pad, generator=g).to(DEVICE, dtype)[:, :k]  # maybe a strided view
    y = torch.randn(m, sum(slot_rows), generator=g).to(DEVICE, dtype)
    got = delta_add(y, x, a, b, bounds, partials, rank)
    assert not bounds[len(slot_rows) + 1 :].any()  # the shrink leaves its semaphores as it found them
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
        (KERNEL_MAX_ROWS, [64], 64, 32),  # the largest size the ops send to the kernels, K below one K step
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pair", ["split", "serial"])
def test_kernel_path_matches_the_two_gemms(m, slot_rows, k, rank, dtype, pair, monkeypatch):
    # "split": every layer up to SPLIT_MAX_ROWS rows takes the split pair (above, the serial one); "serial": all
    monkeypatch.setattr(lora_kernels, "SERIAL_MIN_COLS", 10**9 if pair == "split" else 0)
    check(m, slot_rows, k, rank, dtype)


@needs_kernel
def test_strided_and_batched_inputs():
    check(3, [32, 16], 96, 16, torch.float32, x_stride_pad=7)
    a, b, bounds, partials = layer([32], 64, 16, torch.float32)
    x = torch.randn(2, 3, 64, device=DEVICE)
    y = torch.randn(2, 3, 32, device=DEVICE)
    torch.testing.assert_close(delta_add(y, x, a, b, bounds, partials, 16), lora_delta_add_reference(y, x, a, b),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


@needs_kernel
def test_the_ops_run_the_kernels_up_to_kernel_max_rows_and_the_gemms_above(monkeypatch):
    a, b, bounds, partials = layer([32, 16], 48, 8, torch.float32)
    calls = []
    real = lora_kernels._launch_shrink
    monkeypatch.setattr(lora_kernels, "_launch_shrink", lambda x2, *rest: calls.append(x2.shape[0]) or real(x2, *rest))
    for rows in (1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1):
        x, y = torch.randn(rows, 48, device=DEVICE), torch.randn(rows, 48, device=DEVICE)
        got = delta_add(y, x, a, b, bounds, partials, 8)
        torch.testing.assert_close(got, lora_delta_add_reference(y, x, a, b), rtol=1e-4, atol=1e-4)
    assert calls == [1, KERNEL_MAX_ROWS]


@needs_kernel
def test_the_expand_adds_in_place_and_leaves_the_other_inputs_alone():
    a, b, bounds, partials = layer([32, 16], 48, 8, torch.float32)
    for rows in (4, KERNEL_MAX_ROWS + 1):  # kernel and GEMM paths
        x, y = torch.randn(rows, 48, device=DEVICE), torch.randn(rows, 48, device=DEVICE)
        want = lora_delta_add_reference(y, x, a, b)
        x0, a0, b0, bounds0 = x.clone(), a.clone(), b.clone(), bounds.clone()
        shrunk = lora_shrink(x, a, bounds, partials, 8, 48)
        ptr = y.data_ptr()
        assert lora_expand_(y, shrunk, b, bounds, partials, 8, 48) is None
        assert y.data_ptr() == ptr
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
        for t, t0 in ((x, x0), (a, a0), (b, b0), (bounds, bounds0)):
            assert torch.equal(t, t0)


@needs_kernel
def test_column_major_buffers_are_refused():
    a, b, bounds, partials = layer([32], 64, 16, torch.float32)
    x, y = torch.randn(2, 64, device=DEVICE), torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="row-major"):
        lora_shrink(x, a.t().contiguous().t(), bounds, partials, 16, 32)
    shrunk = lora_shrink(x, a, bounds, partials, 16, 32)
    with pytest.raises(ValueError, match="row-major"):
        lora_expand_(y, shrunk, b.t().contiguous().t(), bounds, partials, 16, 64)


@needs_kernel
def test_scratch_too_small_for_the_rank_is_refused():
    """A bounds buffer built for a smaller LoRA has too few semaphores: a clear error, not a kernel that races."""
    a, b, _, _ = layer([24, 24], 48, 32, torch.float32)
    small = lora_slot_bounds([0, 24], 48, total_rank=2)
    x = torch.randn(KERNEL_MAX_ROWS, 48, device=DEVICE)  # 2 row blocks x 2 LoRA-row blocks: 4 semaphores, 2 there
    with pytest.raises(ValueError, match="scratch is too small"):
        lora_shrink(x, a, small.to(DEVICE), lora_partials(64, DEVICE), 32, 48)
    with pytest.raises(ValueError, match="scratch is too small"):
        lora_shrink(x, a, lora_slot_bounds([0, 24], 48, 64, DEVICE), lora_partials(1, DEVICE), 32, 48)


def test_slot_bounds_are_checked():
    bounds = lora_slot_bounds([0, 96, 128], 160, total_rank=96).tolist()
    assert bounds[:4] == [0, 96, 128, 160]
    assert bounds[4:] == [0] * lora_kernels.semaphores_needed(96) and lora_kernels.semaphores_needed(96) == 3 * 2
    with pytest.raises(ValueError, match="rise from 0"):
        lora_slot_bounds([0, 96, 64], 160, 96)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_ops_trace_under_torch_compile(backend):
    """vLLM compiles the model: the ops must be opaque to dynamo (fake implementations, no graph break), and the
    in-place expand must survive functionalization (``aot_eager``)."""
    a, b, bounds, partials = layer([16, 8], 32, 8, torch.float32)
    x = torch.randn(KERNEL_MAX_ROWS + 3, 32, device=DEVICE)  # the GEMM path: no Triton inside the compiled call
    y = torch.randn(KERNEL_MAX_ROWS + 3, 24, device=DEVICE)

    def fn(y, x):
        y = y * 1  # as in vLLM: the expand's y is an intermediate (the base GEMM's output)
        shrunk = lora_shrink(x, a, bounds, partials, 8, 24)
        lora_expand_(y, shrunk, b, bounds, partials, 8, 32)
        return y * 2

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(y, x), 2 * lora_delta_add_reference(y, x, a, b))

    from qerl_trl.vllm_plugin.lora_kernels import lora_shrink_concat

    def concat(x):  # the expand-in-GEMM input, then a stand-in for the GEMM over it
        return lora_shrink_concat(x * 1, a, bounds, partials, 2).sum(-1)

    want = torch.cat([x, x @ a.t()], dim=-1).sum(-1)
    torch.testing.assert_close(torch.compile(concat, fullgraph=True, backend=backend)(x), want)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="Inductor on CPU needs a C++ compiler")
def test_inductor_reinplaces_the_expand_into_the_base_gemms_output():
    """vLLM compiles the model with Inductor, which functionalizes the mutating expand: it must run it on the base
    GEMM's output buffer itself, with no copy of ``y`` (what the out-of-place two-GEMM path paid for)."""
    import re

    from torch._inductor.utils import run_and_get_code

    a, b, bounds, partials = layer([32, 16], 64, 8, torch.float32)
    w = torch.randn(48, 64, device=DEVICE)

    def linear(x):
        shrunk = lora_shrink(x, a, bounds, partials, 8, 48)
        y = x @ w.t()  # the base GEMM
        lora_expand_(y, shrunk, b, bounds, partials, 8, 64)
        return torch.relu(y)

    x = torch.randn(KERNEL_MAX_ROWS + 44, 64, device=DEVICE)  # the GEMM path: no Triton inside the compiled call
    out, (code,) = run_and_get_code(torch.compile(linear, backend="inductor", fullgraph=True), x)
    torch.testing.assert_close(out, torch.relu(lora_delta_add_reference(x @ w.t(), x, a, b)), rtol=1e-4, atol=1e-4)
    mm_out = re.search(r"extern_kernels\.mm\(.*out=(buf\d+)\)", code).group(1)
    assert re.search(rf"lora_expand_\.default\({mm_out},", code), code  # in place on the GEMM's output
    assert "clone" not in code and ".copy_(" not in code, code


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 64, 128])
def test_qwen25_7b_layer_shapes_on_the_gpu(m):
    # qkv (q 3584, k/v 512), o, gate/up (18944 each), down at r=32, bf16 as vLLM serves them
    for slot_rows, k in (([3584, 512, 512], 3584), ([3584], 3584), ([18944, 18944], 3584), ([3584], 18944)):
        check(m, slot_rows, k, 32, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, KERNEL_MAX_ROWS])
def test_a_cuda_graph_with_a_gemm_between_the_ops_matches_eager(m):
    """As vLLM replays decode: the shrink, a GEMM (the base GEMM's stand-in, writing ``y``), the in-place expand,
    over 4 layers in one CUDA graph, replayed with new inputs and new LoRA weights copied in place: it must match
    the two-GEMM formulation every time."""
    k, slot_rows, r = 3584, [3584, 512, 512], 32
    layers = [layer(slot_rows, k, r, torch.bfloat16, seed=i) for i in range(4)]
    w = torch.randn(sum(slot_rows), k, device=DEVICE, dtype=torch.bfloat16) / k**0.5
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)

    def forward():
        h, outs = x, []
        for a, b, bounds, partials in layers:
            shrunk = lora_shrink(h, a, bounds, partials, r, w.shape[0])
            y = h @ w.t()  # the base GEMM
            lora_expand_(y, shrunk, b, bounds, partials, r, k)
            outs.append(y)
            h = y[:, :k] * 0.5
        return outs

    def reference():
        h, outs = x, []
        for a, b, _, _ in layers:
            y = lora_delta_add_reference(h @ w.t(), h, a, b)
            outs.append(y)
            h = y[:, :k] * 0.5
        return outs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = forward()
    for step in range(3):
        x.copy_(torch.randn_like(x))
        for a, b, _, _ in layers:  # the trainer's push: new weights into the same buffers
            a.copy_(torch.randn_like(a) / k**0.5)
            b.mul_(1.5)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, reference(), strict=True):
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert err < 2e-2, (m, step, err)
    for _, _, bounds, _ in layers:
        assert not bounds[4:].any()


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
    check(3, [96, 32, 32], 512, 32, torch.bfloat16)  # the split pair
    check(17, [96, 32, 32], 512, 32, torch.bfloat16)  # the serial pair
    assert [n for n in seen if n in names] == [*names, *names]  # each kernel compiled once per pair


def _spy_on_pairs(monkeypatch) -> list[str]:
    """The pair of every shrink launched from now on ("split" / "serial")."""
    used: list[str] = []
    real = lora_kernels._launch_shrink
    monkeypatch.setattr(lora_kernels, "_launch_shrink",
                        lambda *args: used.append("serial" if args[-1] else "split") or real(*args))  # fmt: skip
    return used


@needs_kernel
def test_narrow_layers_at_few_rows_take_the_split_pair_and_the_rest_the_serial_one(monkeypatch):
    """Up to SPLIT_MAX_ROWS rows, outputs narrower than SERIAL_MIN_COLS take the split pair; wider outputs, and every
    layer above SPLIT_MAX_ROWS rows, the serial one. Either way the result is right and the semaphores end at 0."""
    monkeypatch.setattr(lora_kernels, "SERIAL_MIN_COLS", 40)
    used = _spy_on_pairs(monkeypatch)
    for slot_rows, rows in (([16, 16], 3), ([24, 24], 3), ([16, 16], lora_kernels.SPLIT_MAX_ROWS + 1)):
        a, b, bounds, partials = layer(slot_rows, 48, 8, torch.float32)
        x, y = torch.randn(rows, 48, device=DEVICE), torch.randn(rows, sum(slot_rows), device=DEVICE)
        torch.testing.assert_close(delta_add(y, x, a, b, bounds, partials, 8), lora_delta_add_reference(y, x, a, b),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        assert not bounds[3:].any()
    assert used == ["split", "serial", "serial"]


@needs_kernel
@pytest.mark.parametrize("m", [1, 5, 70, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_concat_writes_x_then_its_shrink(m, dtype):
    """``[x | x A^T]`` for the expand-in-GEMM layers: the copy of ``x`` exact, the shrink as the serial pair's (the
    kernel up to KERNEL_MAX_ROWS rows, a GEMM above), semaphores left at zero."""
    from qerl_trl.vllm_plugin.lora_kernels import lora_shrink_concat

    slot_rows, k, rank = [96, 32, 32], 200, 8
    a, _, bounds, partials = layer(slot_rows, k, rank, dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, k + 8, generator=g).to(DEVICE, dtype)[:, :k]  # a strided view, as vLLM's q/k/v split gives
    got = lora_shrink_concat(x, a, bounds, partials, len(slot_rows))
    assert got.shape == (m, k + a.shape[0]) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got[:, :k], x)
    want = (x.double() @ a.double().t()).to(dtype).double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (got[:, k:].double() - want).abs().max().item() / (want.abs().max().item() + 1e-9)
    assert err < tol, err
    assert not bounds[len(slot_rows) + 1 :].any()
    if m <= KERNEL_MAX_ROWS:  # the same shrink, bit for bit, as the serial pair's
        shrunk = lora_shrink(x, a, bounds, partials, rank, lora_kernels.SERIAL_MIN_COLS)
        assert torch.equal(got[:, k:], shrunk)
