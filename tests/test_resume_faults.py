"""Resuming after faults (issue #40): a broken checkpoint is named with the file and the last checkpoint that loads,
and a run killed during a checkpoint save resumes from the last complete checkpoint, with the LoRA and the AQN
schedule intact. CPU, a tiny NVFP4 model, real transformers checkpoints."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qerl_trl import QeRLGRPOTrainer
from qerl_trl.aqn import AQNSchedule
from qerl_trl.trainer.checkpoint_check import checkpoint_problem, resolve_resume_checkpoint
from tests.test_trainer_grpo import aqn_log, config, dataset, make_tokenizer, tiny_checkpoint, token_sum_reward  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


def trainer(model: str, out: Path, **kw) -> QeRLGRPOTrainer:
    args = config(out, save_steps=1, **kw)
    return QeRLGRPOTrainer(model=model, reward_funcs=token_sum_reward, args=args, train_dataset=dataset(),
                           processing_class=make_tokenizer())  # fmt: skip


@pytest.fixture(scope="module")
def run(tiny_checkpoint, tmp_path_factory) -> Path:
    """A 3-step run that saved checkpoint-1, -2 and -3 (each with adapter, optimizer, scheduler, state)."""
    out = tmp_path_factory.mktemp("run")
    trainer(tiny_checkpoint, out, max_steps=3).train()
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    return out


def copy_run(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def test_complete_checkpoints_load(run):
    for step in (1, 2, 3):
        assert checkpoint_problem(str(run / f"checkpoint-{step}")) is None
    assert resolve_resume_checkpoint(True, str(run)) == str(run / "checkpoint-3")


def test_a_truncated_adapter_is_named_with_the_checkpoint_to_take_instead(run, tmp_path):
    out = copy_run(run, tmp_path)
    adapter = out / "checkpoint-3" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])
    with pytest.raises(ValueError) as e:
        resolve_resume_checkpoint(str(out / "checkpoint-3"), str(out))
    msg = str(e.value)
    assert msg.startswith(f"Cannot resume from {out / 'checkpoint-3'}: {adapter}: ")
    assert "truncated" in msg
    assert f"The last checkpoint that loads is {out / 'checkpoint-2'}: pass resume_from_checkpoint=" in msg


@pytest.mark.parametrize("damage,expect", [
    ("optimizer.pt", "fails its CRC check (corrupt)"),
    ("scheduler.pt", "not a readable torch archive"),
    ("trainer_state.json", "missing (it is written last: the save did not finish; without it the step count and the AQN"),
    ("adapter_config.json", "adapter_config.json: not valid JSON"),
    ("adapter_nan", "tensors hold NaN or inf"),
])  # fmt: skip
def test_each_broken_file_is_named(run, tmp_path, damage, expect):
    out = copy_run(run, tmp_path)
    ckpt = out / "checkpoint-3"
    if damage == "optimizer.pt":  # flip bytes inside the archive's data
        data = bytearray((ckpt / damage).read_bytes())
        mid = len(data) // 2
        data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
        (ckpt / damage).write_bytes(bytes(data))
    elif damage == "scheduler.pt":
        (ckpt / damage).write_bytes((ckpt / damage).read_bytes()[:50])
    elif damage == "trainer_state.json":
        (ckpt / damage).unlink()
    elif damage == "adapter_config.json":
        (ckpt / damage).write_text("{")
    else:
        from safetensors.torch import save_file

        weights = load_file(ckpt / "adapter_model.safetensors")
        first = sorted(weights)[0]
        weights[first] = torch.full_like(weights[first], float("nan"))
        save_file(weights, ckpt / "adapter_model.safetensors")
    why = checkpoint_problem(str(ckpt))
    assert why is not None and expect in why, why
    with pytest.raises(ValueError, match="The last checkpoint that loads is .*checkpoint-2"):
        resolve_resume_checkpoint(str(ckpt), str(out))


def test_no_checkpoint_that_loads_says_to_train_without_resuming(run, tmp_path):
    out = copy_run(run, tmp_path)
    for step in (1, 2, 3):
        (out / f"checkpoint-{step}" / "trainer_state.json").unlink()
    with pytest.raises(ValueError, match="No other checkpoint beside it loads: train without resume_from_checkpoint"):
        resolve_resume_checkpoint(str(out / "checkpoint-2"), str(out))
    with pytest.raises(ValueError, match=f"No checkpoint in {out} can be resumed"):
        resolve_resume_checkpoint(True, str(out))


def test_the_trainer_refuses_a_broken_checkpoint_before_training(run, tiny_checkpoint, tmp_path):
    out = copy_run(run, tmp_path)
    adapter = out / "checkpoint-2" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:-10])
    t = trainer(tiny_checkpoint, tmp_path / "new", max_steps=4)
    with pytest.raises(ValueError, match=r"Cannot resume from .*checkpoint-2: .*adapter_model.safetensors: its tensors "
                       r"need \d+ bytes but the file has \d+ \(truncated\)\. The last checkpoint that loads is "
                       r".*checkpoint-3"):  # fmt: skip
        t.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert t.state.global_step == 0  # refused before any step


def test_a_run_killed_during_a_save_resumes_from_the_last_complete_checkpoint(tiny_checkpoint, tmp_path, caplog):
    """The process dies in checkpoint-3's save, after its adapter and optimizer and before trainer_state.json (the
    order transformers writes them). resume_from_checkpoint=True skips it for checkpoint-2, whose LoRA it loads,
    and the AQN schedule continues from step 2."""
    out = tmp_path / "run"
    job = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        import transformers
        from tests.test_trainer_grpo import config, dataset, make_tokenizer, token_sum_reward
        from qerl_trl import QeRLGRPOTrainer

        real = transformers.Trainer._save_rng_state
        def save_rng_state(self, output_dir):
            if self.state.global_step == 3:
                os._exit(9)  # killed mid-save: adapter and optimizer written, trainer_state.json not
            return real(self, output_dir)
        transformers.Trainer._save_rng_state = save_rng_state
        args = config({str(out)!r}, save_steps=1, max_steps=4)
        QeRLGRPOTrainer(model={tiny_checkpoint!r}, reward_funcs=token_sum_reward, args=args, train_dataset=dataset(),
                        processing_class=make_tokenizer()).train()
    """)
    proc = subprocess.run([sys.executable, "-c", job], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert proc.returncode == 9, proc.stderr[-3000:]
    assert (out / "checkpoint-3" / "adapter_model.safetensors").exists()
    assert not (out / "checkpoint-3" / "trainer_state.json").exists()

    resumed = trainer(tiny_checkpoint, out, max_steps=4)
    loaded = []
    real_load = resumed._load_from_checkpoint
    resumed._load_from_checkpoint = lambda path, *a, **k: loaded.append(path) or real_load(path, *a, **k)
    with caplog.at_level(logging.WARNING, logger="qerl_trl.trainer.checkpoint_check"):
        resumed.train(resume_from_checkpoint=True)
    warned = [r.getMessage() for r in caplog.records if r.name == "qerl_trl.trainer.checkpoint_check"]
    assert len(warned) == 1 and warned[0].startswith(f"Not resuming from {out / 'checkpoint-3'}: ")
    assert "trainer_state.json: missing" in warned[0]
    assert loaded == [str(out / "checkpoint-2")]
    assert resumed.state.global_step == 4
    # the LoRA the resumed run started from is checkpoint-2's (its first new step moved it from there)
    logged = aqn_log(resumed.state.log_history)
    schedule = AQNSchedule(1e-2, 1e-3, 4)
    for step in (3, 4):
        assert logged[step] == pytest.approx((schedule.sigma(step - 1, 4), schedule.stage(step - 1, 4)))
    final = load_file(out / "checkpoint-4" / "adapter_model.safetensors")
    start = load_file(out / "checkpoint-2" / "adapter_model.safetensors")
    assert final.keys() == start.keys() and any(not torch.equal(final[k], start[k]) for k in final)
