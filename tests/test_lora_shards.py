"""The single-LoRA layout of packed, tensor-parallel vLLM layers (qerl_trl.vllm_plugin.lora_shards), on CPU.

Each test simulates every rank of a TP group and checks that the ranks' LoRA outputs put together equal the
trainer's LoRA (x @ A.T @ B.T * scaling) for each sub-module."""

from __future__ import annotations

import pytest
import torch

from qerl_trl.vllm_plugin.lora_shards import column_parallel_plan, fill_lora_buffers, row_parallel_plan

R, HIDDEN, HEAD = 4, 32, 8
SCALING = 2.0


def _adapter(out: int, inp: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(R, inp, generator=gen, dtype=torch.float64), torch.randn(out, R, generator=gen, dtype=torch.float64)


def _apply(plan, adapters):
    (ra, ca), (rb, cb) = plan.buffer_shapes()
    a = torch.full((ra, ca), float("nan"), dtype=torch.float64)  # every entry the plan owns must be written
    b = torch.zeros(rb, cb, dtype=torch.float64)
    filled = fill_lora_buffers(plan, a, b, adapters, SCALING)
    return a, b, filled


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_qkv_shards_with_replicated_kv_heads_reproduce_each_projection(tp):
    heads, kv_heads = 8, 2  # tp 4 and 8: each KV head replicated on tp // 2 ranks
    gen = torch.Generator().manual_seed(tp)
    full = {"q_proj": _adapter(heads * HEAD, HIDDEN, gen), "k_proj": _adapter(kv_heads * HEAD, HIDDEN, gen),
            "v_proj": _adapter(kv_heads * HEAD, HIDDEN, gen)}  # fmt: skip
    x = torch.randn(5, HIDDEN, generator=gen, dtype=torch.float64)
    want = {n: x @ a.T @ b.T * SCALING for n, (a, b) in full.items()}
    replicas = max(1, tp // kv_heads)
    local_kv = max(1, kv_heads // tp)
    for tp_rank in range(tp):
        sizes = [heads // tp * HEAD, local_kv * HEAD, local_kv * HEAD]
        kv_shard = tp_rank // replicas
        plan = column_parallel_plan(["q_proj", "k_proj", "v_proj"], sizes, HIDDEN, R, [tp_rank, kv_shard, kv_shard])
        a, b, filled = _apply(plan, full)
        assert filled == ["q_proj", "k_proj", "v_proj"]
        y = x @ a.T @ b.T  # what the layer adds to its local output
        q, k, v = y.split(sizes, dim=1)
        torch.testing.assert_close(q, want["q_proj"][:, tp_rank * sizes[0] : (tp_rank + 1) * sizes[0]])
        torch.testing.assert_close(k, want["k_proj"][:, kv_shard * sizes[1] : (kv_shard + 1) * sizes[1]])
        torch.testing.assert_close(v, want["v_proj"][:, kv_shard * sizes[2] : (kv_shard + 1) * sizes[2]])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_partial_expands_sum_to_the_full_lora(tp):
    gen = torch.Generator().manual_seed(10 + tp)
    inter, out = 64, HIDDEN
    full = {"down_proj": _adapter(out, inter, gen)}
    x = torch.randn(3, inter, generator=gen, dtype=torch.float64)
    a_full, b_full = full["down_proj"]
    total = torch.zeros(3, out, dtype=torch.float64)
    for tp_rank in range(tp):
        plan = row_parallel_plan("down_proj", out, inter // tp, tp_rank, R)
        a, b, _ = _apply(plan, full)
        x_local = x[:, tp_rank * inter // tp : (tp_rank + 1) * inter // tp]  # the layer's input shard
        total += x_local @ a.T @ b.T  # before the all-reduce
    torch.testing.assert_close(total, x @ a_full.T @ b_full.T * SCALING)


def test_an_untargeted_sub_module_gets_zeros_and_the_others_their_lora():
    gen = torch.Generator().manual_seed(0)
    plan = column_parallel_plan(["gate_proj", "up_proj"], [16, 16], HIDDEN, R, [0, 0])
    up = _adapter(16, HIDDEN, gen)
    a, b, filled = _apply(plan, {"up_proj": up})
    assert filled == ["up_proj"]
    assert not a[:R].any() and not b[:16].any() and not b[16:, :R].any()  # gate: no LoRA; off-diagonal: zero
    x = torch.randn(2, HIDDEN, generator=gen, dtype=torch.float64)
    torch.testing.assert_close((x @ a.T @ b.T)[:, 16:], x @ up[0].T @ up[1].T * SCALING)


def test_refill_is_in_place_and_replaces_the_previous_adapter():
    gen = torch.Generator().manual_seed(1)
    plan = column_parallel_plan(["o"], [HIDDEN], HIDDEN, R, [0])
    (ra, ca), (rb, cb) = plan.buffer_shapes()
    a, b = torch.zeros(ra, ca), torch.zeros(rb, cb)
    ptrs = (a.data_ptr(), b.data_ptr())
    for _ in range(2):
        new = (torch.randn(R, HIDDEN, generator=gen), torch.randn(HIDDEN, R, generator=gen))
        fill_lora_buffers(plan, a, b, {"o": new}, 0.5)
        torch.testing.assert_close(a, new[0])
        torch.testing.assert_close(b, new[1] * 0.5)
    assert (a.data_ptr(), b.data_ptr()) == ptrs


def test_mismatched_shapes_and_names_are_clear_errors():
    plan = column_parallel_plan(["q_proj"], [16], HIDDEN, R, [0])
    (ra, ca), (rb, cb) = plan.buffer_shapes()
    a, b = torch.zeros(ra, ca), torch.zeros(rb, cb)
    with pytest.raises(ValueError, match="rank 4"):
        fill_lora_buffers(plan, a, b, {"q_proj": (torch.zeros(8, HIDDEN), torch.zeros(16, 8))}, 1.0)
    with pytest.raises(KeyError, match="k_proj"):
        fill_lora_buffers(plan, a, b, {"k_proj": (torch.zeros(R, HIDDEN), torch.zeros(16, R))}, 1.0)
    with pytest.raises(ValueError, match="buffers"):
        fill_lora_buffers(plan, torch.zeros(1, 1), b, {}, 1.0)
    with pytest.raises(ValueError, match="equal"):
        column_parallel_plan(["q_proj", "k_proj"], [16], HIDDEN, R, [0])
    with pytest.raises(ValueError, match="rank must be"):
        row_parallel_plan("o_proj", 16, 16, 0, 0)
