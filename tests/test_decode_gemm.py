"""The NVFP4 + LoRA decode GEMM (``qerl_trl.vllm_plugin.decode_gemm``) against the dequantized reference.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (what CI sets) with its portable dequantization; on a GPU the same
tests run the compiled kernel (the PTX dequantization, wgmma on Hopper), and the ``gpu`` tests below run every linear
of Qwen2.5 7B, 14B and 32B at decode sizes, bf16 and fp16, LoRA on and off."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import packed_lora

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from qerl_trl.nvfp4.format import dequantize, quantize  # noqa: E402
from qerl_trl.vllm_plugin import decode_gemm as dg  # noqa: E402
from qerl_trl.vllm_plugin.lora_kernels import lora_slot_bounds  # noqa: E402
from qerl_trl.vllm_plugin.lora_shards import column_parallel_plan, fill_lora_buffers, row_parallel_plan  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def nvfp4(n: int, k: int, dtype: torch.dtype, seed: int = 0, global_scale: torch.Tensor | None = None):
    g = torch.Generator().manual_seed(seed)
    return quantize((torch.randn(n, k, generator=g) * 0.05).to(dtype).to(DEVICE), global_scale)


def lora(slot_rows: list[int], k: int, rank: int, dtype: torch.dtype, seed: int = 1):
    return packed_lora(slot_rows, k, rank, dtype, DEVICE, seed, b_scale=0.1)


def want(x, q, a=None, b=None) -> torch.Tensor:
    """fp64 from the same rounded inputs; the shrink rounded to the activation dtype as both paths do."""
    w = dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale, torch.float32).double()
    y = x.double() @ w.t()
    if a is not None:
        y = y + (x.double() @ a.double().t()).to(x.dtype).double() @ b.double().t()
    return y


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.double() - ref).norm() / ref.norm()).item()


#: bf16 rounding of the output (2^-9 relative, ~2^-9.5 in norm) plus fp32 accumulation and the rounded shrink
TOL = {torch.bfloat16: 6e-3, torch.float16: 1e-3}


def run(m, slot_rows, k, rank, dtype, cfg=None, sems=None, q=None):
    n = sum(slot_rows)
    q = nvfp4(n, k, dtype) if q is None else q
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    a, b, bounds = lora(slot_rows, k, rank, dtype) if rank else (None, None, None)
    sems = dg.decode_workspace(n, DEVICE) if sems is None else sems
    got = dg._launch(x, q.weight_packed, q.weight_scale.view(torch.uint8), q.weight_global_scale, a, b, bounds, rank,
                     sems, cfg)  # fmt: skip
    assert got.shape == (m, n) and got.dtype == dtype
    assert not sems.any(), "the split-K semaphores must end at zero"
    if bounds is not None:
        assert not bounds[len(slot_rows) + 1 :].any(), "the shrink's semaphores must end at zero"
    err = rel(got, want(x, q, a, b))
    assert err < TOL[dtype], (m, slot_rows, k, rank, dtype, cfg, err)
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [0, 8])
@pytest.mark.parametrize(
    "m,slot_rows,k,cfg",
    [
        (1, [64], 256, None),
        # the pointer kernel (layers whose rows the copy engine cannot address)
        (3, [96, 32, 32], 512, dg.DecodeConfig(64, 128, 16, 3, 4, 1, tma=False)),  # split K, q/k/v slots
        (17, [48, 80], 384, dg.DecodeConfig(32, 128, 32, 2, 4, 1, tma=False)),  # a slot boundary inside a tile
        (5, [40], 320, dg.DecodeConfig(32, 256, 16, 2, 4, 1, tma=False)),  # K not a multiple of the K step
        (20, [64, 64], 256, dg.DecodeConfig(64, 128, 16, 2, 4, 1, tma=False)),  # two token blocks, split K
        # the TMA kernel
        (3, [96, 32, 32], 1024, dg.DecodeConfig(64, 256, 16, 2, 4, 2)),  # split K, q/k/v slots
        (33, [80, 48], 512, dg.DecodeConfig(64, 256, 32, 1, 4, 3)),  # ragged tiles, zero-filled; a slot boundary
        (70, [64], 768, dg.DecodeConfig(32, 256, 64, 3, 4, 2)),  # two token blocks
        (5, [96, 32, 32], 1024, dg.DecodeConfig(64, 256, 16, 2, 4, 3, quad=True)),  # one byte per lane of a quad
    ],
)
def test_matches_the_dequantized_reference(m, slot_rows, k, cfg, rank, dtype):
    run(m, slot_rows, k, rank, dtype, cfg)


def test_the_config_splits_k_for_few_tiles_and_not_for_many():
    dev = torch.device("cpu")
    few = dg.decode_config(1, 3584, 18944, dev)  # down: 56 tiles of 64 rows
    many = dg.decode_config(1, 37888, 3584, dev)  # gate/up: 592 tiles
    assert few.splits > 1 and many.splits == 1
    assert dg.decode_config(256, 37888, 3584, dev).bt == dg.BT_MAX and dg.decode_config(3, 512, 512, dev).bt == 16
    assert not dg.decode_config(16, 512, 512, dev).quad and dg.decode_config(17, 512, 512, dev).quad
    steps = -(-18944 // few.bk)
    assert -(-steps // few.splits) * (few.splits - 1) < steps  # no split is empty


def test_errors_name_what_is_wrong():
    q = nvfp4(64, 256, torch.bfloat16)
    x = torch.randn(2, 128, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not match 128 input columns"):
        dg.nvfp4_lora_linear(x, q.weight_packed, q.weight_scale, q.weight_global_scale, None, None, None, 0,
                             dg.decode_workspace(64, DEVICE))  # fmt: skip
    x = torch.randn(dg.MAX_ROWS + 1, 256, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="takes 1 to 256 rows"):
        dg.nvfp4_lora_linear(x, q.weight_packed, q.weight_scale, q.weight_global_scale, None, None, None, 0,
                             dg.decode_workspace(64, DEVICE))  # fmt: skip
    x = torch.randn(3, 256, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="semaphores needed"):
        dg._launch(x, q.weight_packed, q.weight_scale.view(torch.uint8), q.weight_global_scale, None, None, None, 0,
                   torch.zeros(1, dtype=torch.int32, device=DEVICE), dg.DecodeConfig(16, 64, 16, 2, 4, 1, False))  # fmt: skip


def test_the_op_keeps_leading_dims_and_traces_under_torch_compile():
    """vLLM compiles the model: the op is opaque to dynamo (a fake implementation, no graph break)."""
    slot_rows, k, rank = [64, 32], 256, 8
    q = nvfp4(96, k, torch.bfloat16)
    a, b, bounds = lora(slot_rows, k, rank, torch.bfloat16)
    sems = dg.decode_workspace(96, DEVICE)
    x = torch.randn(2, 3, k, device=DEVICE, dtype=torch.bfloat16)

    def fn(x):
        return dg.nvfp4_lora_linear(x, q.weight_packed, q.weight_scale, q.weight_global_scale, a, b, bounds, rank,
                                    sems) * 2  # fmt: skip

    got = torch.compile(fn, fullgraph=True, backend="eager")(x)
    assert got.shape == (2, 3, 96)
    assert rel(got.reshape(6, 96) / 2, want(x.reshape(6, k), q, a, b)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards_add_up_to_the_full_layer(tp):
    """Every rank runs the kernel on its shard of the checkpoint's packed tensors (the global scale shared, as vLLM
    loads them), with the LoRA buffers ``lora_shards`` lays out for it: column-parallel gate/up (B's rows of the
    rank's output shard) concatenate, and row-parallel down (A's columns of the input shard) sums to the full
    layer's output, as vLLM's all-reduce does."""
    dtype, rank, k, out = torch.bfloat16, 8, 512, 128
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, k, generator=gen).to(DEVICE, dtype)

    def adapter(n_out, n_in):
        return ((torch.randn(rank, n_in, generator=gen) / n_in**0.5).to(DEVICE, dtype),
                (torch.randn(n_out, rank, generator=gen) * 0.1).to(DEVICE, dtype))  # fmt: skip

    def full_ref(q, a, b):
        return want(x, q) + (x.double() @ a.double().t()).to(dtype).double() @ b.double().t()

    # column-parallel gate/up: each [out, k]; rank r holds rows r*out/tp.. of each
    shared = nvfp4(out, k, dtype, seed=10).weight_global_scale  # packed sub-modules share one global scale
    qs = {nm: nvfp4(out, k, dtype, seed=10 + i, global_scale=shared) for i, nm in enumerate(("gate", "up"))}
    ads = {nm: adapter(out, k) for nm in qs}
    rows = out // tp
    outs = []
    for r in range(tp):
        sl = slice(r * rows, (r + 1) * rows)
        packed = torch.cat([qs[nm].weight_packed[sl] for nm in ("gate", "up")])
        scale = torch.cat([qs[nm].weight_scale[sl] for nm in ("gate", "up")])
        plan = column_parallel_plan(["gate", "up"], [rows, rows], k, rank, [r, r])
        outs.append(_rank_output(x, (packed, scale, qs["gate"].weight_global_scale), plan, ads, dtype))
    for i, nm in enumerate(("gate", "up")):
        got = torch.cat([o[:, i * rows : (i + 1) * rows] for o in outs], 1)
        assert rel(got, full_ref(qs[nm], *ads[nm])) < TOL[dtype], nm
    # row-parallel down: [out, k]; rank r holds input columns r*k/tp..
    q = nvfp4(out, k, dtype, seed=20)
    a, b = adapter(out, k)
    part = k // tp
    total = sum(_rank_output(x[:, r * part : (r + 1) * part],
                             (q.weight_packed[:, r * part // 2 : (r + 1) * part // 2],
                              q.weight_scale[:, r * part // 16 : (r + 1) * part // 16], q.weight_global_scale),
                             row_parallel_plan("down", out, part, r, rank), {"down": (a, b)}, dtype).double()
                for r in range(tp))  # fmt: skip
    # each rank rounds its own partial shrink and output to bf16: a little looser than one rank's
    assert rel(total, full_ref(q, a, b)) < 2 * TOL[dtype]


def _rank_output(x, shard, plan, adapters, dtype):
    """One rank's layer output from its packed weight shard and LoRA buffers filled by ``fill_lora_buffers``."""
    (ra, ca), (rb, cb) = plan.buffer_shapes()
    la = torch.zeros(ra, ca, dtype=dtype, device=DEVICE)
    lb = torch.zeros(rb, cb, dtype=dtype, device=DEVICE)
    fill_lora_buffers(plan, la, lb, adapters, 1.0)
    packed, scale, gscale = (t.contiguous() for t in shard)
    bounds = lora_slot_bounds([s.out_start for s in plan.slots], plan.out_rows, DEVICE)
    x = x.contiguous()
    return dg.nvfp4_lora_linear(x, packed, scale, gscale, la, lb, bounds, plan.rank,
                                dg.decode_workspace(plan.out_rows, DEVICE))  # fmt: skip


# ---------------------------------------------------------------------------------------------------- GPU only
QWEN25 = {
    "7b": [([3584, 512, 512], 3584), ([3584], 3584), ([18944, 18944], 3584), ([3584], 18944)],
    "14b": [([5120, 1024, 1024], 5120), ([5120], 5120), ([13824, 13824], 5120), ([5120], 13824)],
    "32b": [([5120, 1024, 1024], 5120), ([5120], 5120), ([27648, 27648], 5120), ([5120], 27648)],
}


@pytest.mark.gpu
@pytest.mark.parametrize("size", list(QWEN25))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qwen25_layer_shapes_on_the_gpu(size, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine with `pytest -m gpu`)")
    for slot_rows, k in QWEN25[size]:
        g = torch.Generator(DEVICE).manual_seed(0)
        q = quantize(torch.randn(sum(slot_rows), k, generator=g, device=DEVICE, dtype=dtype) * 0.05)
        for m in (1, 7, 16, 64, 200, 256):
            for rank in (0, 32):
                run(m, slot_rows, k, rank, dtype, q=q)


@pytest.mark.gpu
def test_cuda_graph_replay_sees_new_inputs_and_adapters():
    """Captured once, replayed with new activations and a LoRA copied into the same buffers (as the trainer's sync
    does): the output follows both, and the semaphores end at zero."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    slot_rows, k, rank, dtype = [3584, 512, 512], 3584, 32, torch.bfloat16
    q = nvfp4(sum(slot_rows), k, dtype)
    a, b, bounds = lora(slot_rows, k, rank, dtype)
    sems = dg.decode_workspace(sum(slot_rows), DEVICE)
    x = torch.randn(4, k, device=DEVICE, dtype=dtype)

    def fn():
        return dg.nvfp4_lora_linear(x, q.weight_packed, q.weight_scale, q.weight_global_scale, a, b, bounds, rank, sems)

    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn()
    a2, b2, _ = lora(slot_rows, k, rank, dtype, seed=7)
    x.copy_(torch.randn_like(x))
    a.copy_(a2)
    b.copy_(b2)
    graph.replay()
    torch.cuda.synchronize()
    assert rel(y, want(x, q, a, b)) < TOL[dtype]
    assert not sems.any()


@pytest.mark.gpu
def test_the_kernel_compiles_under_a_serializing_jit_hook(monkeypatch):
    """vLLM's worker installs a Triton JIT hook after its warm-up (``vllm/triton_utils/jit_monitor.py``, 0.24): Triton
    then JSON-serializes every compile's constexprs. The kernel compiles under it and stays right."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from triton import knobs

    compiled: list[str] = []

    def before(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        json.loads(compile["specialization_data"])
        return False

    def after(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        json.loads(compile["specialization_data"])
        compiled.append(fn.name)
        return False

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", before)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", after)
    for kernel, launch in ((dg._decode_gemm_kernel, dg._gemm_launch), (dg._decode_gemm_tma_kernel, dg._gemm_tma_launch)):
        kernel.device_caches.clear()
        launch.clear()
    run(3, [96, 32, 32], 512, 32, torch.bfloat16, dg.DecodeConfig(64, 128, 16, 2, 4, 1, tma=False))
    run(3, [96, 32, 32], 512, 32, torch.bfloat16, dg.DecodeConfig(64, 256, 16, 2, 4, 2))
    assert compiled.count("_decode_gemm_kernel") == 1 and compiled.count("_decode_gemm_tma_kernel") == 1
