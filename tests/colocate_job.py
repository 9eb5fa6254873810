"""What the real-shape colocate GPU tests share (``test_real_shape_colocate``, ``test_moe_colocate_gpu``): running a
test file's job in a fresh process (one colocated engine per process, as in training) and the checks after its
3 training steps."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import torch
from torch import nn

LOGPROB_TOL = 0.05  # mean |Δ log p| per token, vLLM (FP4 + LoRA) vs the trainer (as benchmarks/colocate_check)
SERVED_MIN = 5 * LOGPROB_TOL
AQN_REL_TOL = 0.10  # realized σ in vLLM's norms against the schedule's (as benchmarks/colocate_check)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_job_in_child(test_file: str, lora_backend: str, tmp_path) -> None:
    """``python <test_file> <lora_backend> <tmp_path>`` in a fresh process; it must pass its log-prob check."""
    from qerl_trl.study.runner import child_env

    env = {**child_env(os.environ, os.cpu_count() or 1), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, test_file, lora_backend, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=570, cwd=REPO)  # fmt: skip
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert "logprob check:" in proc.stdout


def check_trained(trainer, rounds: list[dict], lora0: dict[str, torch.Tensor], sigmas: tuple[float, float, int],
                  steps: int = 3) -> None:  # fmt: skip
    """After ``trainer.train()``: finite losses, AQN's σ (``sigmas``: start, end, stages) realized in vLLM's norms in
    ``rounds`` (``colocate_check.record_aqn_in_vllm``), the rollout guard quiet, most LoRA tensors moved, and vLLM's
    log-probs of a fixed completion matching the trainer's after a sync, the adapter moving them."""
    from benchmarks.colocate_check import lora_logprob_check
    from qerl_trl.aqn import AQNSchedule

    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == steps and all(math.isfinite(h["loss"]) for h in logged), logged
    assert any(h.get("aqn/sigma", 0) > 0 for h in logged), "AQN never noised a rollout"
    schedule = AQNSchedule(*sigmas)
    noised = [r for r in rounds if r["stage"] > 0]
    assert noised, rounds
    for r in noised:  # the noise reached vLLM's (float32) norms at the scheduled σ
        want = schedule.sigma(r["step"], steps)
        assert abs(r["realized_std"] - want) <= AQN_REL_TOL * want, r
        assert r["vllm_norm_dtypes"] == ["torch.float32"], r
    guard = trainer._rollout_guard
    assert guard is not None and guard.last is not None and not guard.bad_rounds, (guard.last, guard.bad_rounds)
    params = dict(trainer.model.named_parameters())
    moved = [n for n, p in lora0.items() if not torch.equal(params[n].detach(), p)]
    assert len(moved) > len(lora0) // 2, f"only {len(moved)} of {len(lora0)} LoRA tensors changed"
    lp = lora_logprob_check(trainer)
    print("logprob check:", json.dumps(lp))
    assert lp["match"] <= LOGPROB_TOL, lp
    assert lp["served"] >= SERVED_MIN, lp


def train_and_check(trainer, frozen_type: type[nn.Module], frozen_attr: str, sigmas: tuple[float, float, int],
                    steps: int = 3, frozen_device: str | None = None,
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:  # fmt: skip
    """Train with AQN recorded in vLLM, run :func:`check_trained`, and check that every ``frozen_type`` module's
    ``frozen_attr`` (the packed base) did not change; returns ``(frozen tensors, LoRA tensors)`` as they started.
    ``frozen_device``: where the starting copy of the packed base is kept (``"cpu"`` where it would crowd the GPU)."""
    from benchmarks.colocate_check import record_aqn_in_vllm

    model = trainer.model
    frozen = {n: getattr(m, frozen_attr).detach().to(frozen_device, copy=True) for n, m in model.named_modules()
              if isinstance(m, frozen_type)}  # fmt: skip
    lora0 = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    rounds, stop_recording = record_aqn_in_vllm(trainer)
    trainer.train()
    stop_recording()
    check_trained(trainer, rounds, lora0, sigmas, steps)
    for n, m in model.named_modules():
        if isinstance(m, frozen_type):
            now = getattr(m, frozen_attr)
            assert torch.equal(now.to(frozen[n].device), frozen[n]), f"the packed base of {n} changed"
    return frozen, lora0


def main(job) -> None:
    """A test file's ``__main__``: ``job(lora_backend, tmp_path)`` from the command line :func:`run_job_in_child`
    gives it, with the repository first on the path."""
    import pathlib

    sys.path[:0] = [REPO]
    job(sys.argv[1], pathlib.Path(sys.argv[2]))
