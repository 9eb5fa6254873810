"""``benchmarks/lora_delta.py``'s shrink settings (``--partial-rows``, ``--shrink-bm``): each arm runs the shipped
single-LoRA ops with another partial-row budget and row block, and they must still add the exact delta, with scratch
allocated once for every arm. On CPU under ``TRITON_INTERPRET=1`` (what CI sets); the timing is the GPU run."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import packed_lora

from benchmarks import lora_delta as ld
from qerl_trl.vllm_plugin import lora_kernels as lk

needs_kernel = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                  reason="Triton on CPU needs TRITON_INTERPRET=1")  # fmt: skip


def test_the_arms_are_the_shipped_settings_first_then_each_other_combination_once():
    shipped = (lk.PARTIAL_ROWS, lk._BM_MAX)
    assert ld.shrink_arms([], []) == [shipped]
    arms = ld.shrink_arms([2048, lk.PARTIAL_ROWS], [16, lk._BM_MAX])
    assert arms[0] == shipped and len(arms) == len(set(arms)) == 4
    assert set(arms) == {shipped, (lk.PARTIAL_ROWS, 16), (2048, lk._BM_MAX), (2048, 16)}
    assert ld.shrink_arms([2048], [16, 32], rows=64) == [shipped, (lk.PARTIAL_ROWS, 16), (lk.PARTIAL_ROWS, 32),
                                                         (2048, lk._BM_MAX), (2048, 16), (2048, 32)]  # fmt: skip
    # 16 rows run in one 16-row block whatever the largest block, and 32 rows in one of 32: those arms would repeat
    assert ld.shrink_arms([2048], [16, 32], rows=16) == [shipped, (2048, lk._BM_MAX)]
    assert ld.shrink_arms([], [16, 32], rows=32) == [shipped, (lk.PARTIAL_ROWS, 16)]


def test_the_settings_apply_inside_the_block_only_and_come_back_after_an_error():
    shipped = (lk.PARTIAL_ROWS, lk._BM_MAX)
    with pytest.raises(RuntimeError):
        with ld.shrink_settings(4096, 16):
            assert (lk.PARTIAL_ROWS, lk._BM_MAX) == (4096, 16)
            raise RuntimeError
    assert (lk.PARTIAL_ROWS, lk._BM_MAX) == shipped


@needs_kernel
@pytest.mark.parametrize("rows", [16, 64])
def test_every_arm_adds_the_exact_delta_from_scratch_sized_for_all_arms(rows, monkeypatch):
    """A long-K layer (``down_proj``-like: K = 64 x 128, one slot) at 16 and 64 rows, where the arms differ: more K
    splits and 16-row blocks give the shrink more programs and the summing program fewer partials."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    k, n, rank = 8192, 64, 16
    arms = ld.shrink_arms([2048], [16], rows)
    with ld.shrink_settings(max(b for b, _ in arms), min(m for _, m in arms)):  # as lora_delta.py allocates
        a, b, bounds = packed_lora([n], k, rank, torch.float32, dev, 0)
        partials = lk.lora_partials(rank, dev)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, k, generator=g).to(dev)
    y0 = torch.randn(rows, n, generator=g).to(dev)
    want = y0.double() + (x.double() @ a.double().t()) @ b.double().t()
    grids = []
    for budget, bm in arms:
        for serial_min_cols in (0, 10**9):  # the serial pair, and (at up to 16 rows) the split pair
            monkeypatch.setattr(lk, "SERIAL_MIN_COLS", serial_min_cols)
            with ld.shrink_settings(budget, bm):
                y = y0.clone()
                shrunk = lk.lora_shrink(x, a, bounds, partials, rank, n)
                lk.lora_expand_(y, shrunk, b, bounds, partials, rank, k)
                bm_used, m_blocks = lk._row_blocks(rows)
                grids.append((lk._splits(rows, k, bm_used, m_blocks)[0], m_blocks))
            torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)
            assert not bounds[2:].any()  # the semaphores are back at zero
    assert len(set(grids)) == len(arms)  # each arm launches its own grid (K splits, row blocks)
