"""CPU tests of benchmarks/decode_profile.py: the categories, the busy-time union and the per-step difference."""

from __future__ import annotations

import types

import pytest
import torch

from benchmarks import decode_profile as dp


@pytest.mark.parametrize("name,cat", [
    ("void humming<TuningConfig<128, 1>>(...)", "fp4_gemm"),
    ("void marlin::Marlin<...>", "fp4_gemm"),
    ("_lora_shrink_kernel", "lora"),
    ("flash::FlashAttnFwdSm90<...>", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<...>", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm_rope_act"),
    ("void vllm::act_and_mul_kernel<...>", "norm_rope_act"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "logits_gemm"),
    ("void at::native::reduce_kernel<512, 1, ...ArgMaxOps...>", "sampling"),
    ("Memcpy HtoD (Pageable -> Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "other"),
])
def test_categories(name, cat):
    assert dp.category(name) == cat


def test_busy_is_the_union_of_intervals():
    assert dp.busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 12 + 5
    assert dp.busy_us([]) == 0


def _events(steps: int, t0: float = 0.0):
    """A fake generate: a 100 us prefill kernel, then per step a 30 us FP4 GEMM, a 10 us LoRA kernel overlapping it
    on another stream, a 5 us sampling kernel, and a 20 us host gap before the next step."""
    ev, t = [("humming_prefill", t0, t0 + 100.0)], t0 + 100.0
    for _ in range(steps):
        ev += [("humming<cfg>", t, t + 30), ("_lora_expand_kernel", t + 25, t + 35),
               ("argmax reduce_kernel", t + 35, t + 40)]
        t += 60
    return ev


def test_per_step_is_the_difference_over_the_extra_steps():
    short, long = dp.summarize(_events(4)), dp.summarize(_events(4 + 10, t0=1e6))
    step = dp.per_step(short, long, 10, fp4_weight_bytes=3_000_000)
    assert step["ms_by_category"] == {"fp4_gemm": 0.03, "lora": 0.01, "sampling": 0.005}
    assert step["step_ms"] == pytest.approx(0.06) and step["gpu_busy_ms"] == pytest.approx(0.04)
    assert step["host_gap_ms"] == pytest.approx(0.02)
    assert step["fp4_gemm_gb_per_s"] == pytest.approx(3_000_000 / 30e-6 / 1e9)
    assert step["top_kernels"][0] == {"kernel": "humming<cfg>", "category": "fp4_gemm", "ms": 0.03, "calls": 1.0}
    assert "humming_prefill" not in {k["kernel"] for k in step["top_kernels"] if k["ms"] > 0}


def test_fp4_bytes_of_a_qwen25_7b_step():
    cfg = types.SimpleNamespace(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                num_key_value_heads=4, num_hidden_layers=28, head_dim=None)
    weights = 28 * (3584 * 3584 * 2 + 2 * 3584 * 512 + 3 * 3584 * 18944)
    assert dp.fp4_weight_bytes(cfg) == pytest.approx(weights * (0.5 + 1 / 16), rel=1e-6)


def test_gpu_events_keeps_device_events_only():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = [types.SimpleNamespace(name=n, device_type=d, time_range=types.SimpleNamespace(start=s, end=e))
          for n, d, s, e in [("k", cuda, 1, 2), ("aten::mm", cpu, 0, 5)]]
    assert dp.gpu_events(types.SimpleNamespace(events=lambda: ev)) == [("k", 1.0, 2.0)]


def test_table_has_a_line_per_profiled_row():
    step = dp.per_step(dp.summarize(_events(2)), dp.summarize(_events(12)), 10, 3_000_000)
    rows = [dict(arm="nvfp4_qerl_lora", kernel="humming", batch=16, decode_profile=step), dict(arm="x", batch=1)]
    text = dp.table(rows)
    assert text.count("\n") == 2 and "| nvfp4_qerl_lora@humming | 16 | 0.060 |" in text
