"""CPU checks of ``benchmarks/rollout.py`` (the engines themselves run on the GPU machine): the random adapter is a
valid PEFT LoRA on every linear of the model, speed-ups are against merged BF16 at the same size and batch, and the
32B BF16 arm is recorded as not run."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import rollout  # noqa: E402


def test_random_adapter_loads_into_the_model_with_every_linear_targeted(tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

    from conftest import tiny_model

    model = tiny_model("qwen2", dtype=torch.float32)
    path = rollout.write_random_adapter(str(tmp_path / "adapter"), model.config, r=8)
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(saved) == 2 * 7 * model.config.num_hidden_layers
    peft_model = PeftModel.from_pretrained(model, path)
    loaded = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(saved)
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    assert torch.equal(loaded[name.replace(".weight", ".default.weight")].float(), saved[name].float())
    assert saved[name].abs().max() > 0  # B non-zero: vLLM really applies the adapter


def test_speedups_are_against_merged_bf16_at_the_same_size_and_batch():
    rows = [
        dict(size="7b", arm="bf16_merged", batch=8, tokens_per_s=100.0, status="ok"),
        dict(size="7b", arm="nvfp4", batch=8, tokens_per_s=150.0, status="ok"),
        dict(size="7b", arm="nvfp4_vllm_lora", batch=8, tokens_per_s=120.0, status="ok"),
        dict(size="7b", arm="nvfp4_vllm_lora", batch=64, tokens_per_s=500.0, status="ok"),
        dict(size="32b", arm="bf16_merged", batch=8, status="not_run: disk"),
    ]
    rollout.add_speedups(rows)
    assert [r["vs_bf16_merged"] for r in rows] == [1.0, 1.5, 1.2, None, None]
    assert rows[2]["lora_overhead_vs_nvfp4"] == 0.25 and rows[3]["lora_overhead_vs_nvfp4"] is None


def test_32b_bf16_is_recorded_as_not_run():
    spec = rollout.EngineSpec("32b", "bf16_merged", (1, 8))
    rows = rollout.run_engine(spec, "/nonexistent")
    assert [r["batch"] for r in rows] == [1, 8] and all(r["status"].startswith("not_run: a 32B BF16") for r in rows)
