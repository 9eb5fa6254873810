"""The job users run, at real shapes: QeRLGRPOTrainer with vLLM colocate on a Qwen2.5-shaped random model.

``pytest -m vllm`` on the GPU machine (vLLM, TRL and datasets from the GPU bundle). Checkpoints are written once per
machine under ``$QERL_E2E_WORK`` (default ``/tmp/qerl-e2e``, shared with ``benchmarks/e2e_step.py``).

1.5B shapes, every kernel path enabled, AQN on, sleep mode level 1, 3 steps, under each LoRA backend with the FP4
  kernel as shipped (``vllm_fp4_kernel="auto"``: Humming on a Hopper GPU where ``humming-kernels`` is installed,
  whose shapes every 1.5B layer fits): vLLM's JIT monitor is active when training starts and our kernels compile
  under it (the crash at f675bcc), the loss is finite, the LoRA moves, the packed base does not, AQN's σ is realized
  in vLLM's norms, the rollout guard stays quiet, and after a sync vLLM's log-probs of a fixed completion match the
  trainer's. The engine's start time is printed (the first Humming start on a machine compiles its kernels).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

WORK = os.environ.get("QERL_E2E_WORK", "/tmp/qerl-e2e")
LOGPROB_TOL = 0.05  # mean |Δ log p| per token, vLLM (FP4 + LoRA) vs the trainer (as benchmarks/colocate_check)
SERVED_MIN = 5 * LOGPROB_TOL
AQN_REL_TOL = 0.10  # realized σ in vLLM's norms against the schedule's (as benchmarks/colocate_check)


def _expected_kernel() -> str:
    from qerl_trl.vllm_plugin.fp4_kernel import installed_humming_version

    return "humming" if installed_humming_version() and torch.cuda.get_device_capability()[0] == 9 else "marlin"


def _qerl_trainer(path: str, out: str, steps: int, lora_backend: str):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from benchmarks import random_models as rm
    from qerl_trl import QeRLGRPOConfig, QeRLGRPOTrainer

    tok = AutoTokenizer.from_pretrained(path)
    prompts = rm.make_prompts(2 * (steps + 1), 64, seed=0, tokenizer=tok)
    args = QeRLGRPOConfig(
        output_dir=out, report_to="none", max_steps=steps, logging_steps=1, save_strategy="no", seed=0, bf16=True,
        gradient_checkpointing=True, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, max_completion_length=96, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3, vllm_max_model_length=256, vllm_enable_sleep_mode=True,
        aqn=True, aqn_sigma_start=1e-2, aqn_sigma_end=1e-3, aqn_num_stages=3, learning_rate=1e-4,
        vllm_lora_backend=lora_backend,
    )

    def reward(completions, **kw):
        return [float(sum(map(ord, c)) % 97) / 97 for c in completions]

    return QeRLGRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict(
        {"prompt": prompts}), processing_class=tok)


@pytest.mark.parametrize("lora_backend", ["qerl", "vllm"])
def test_colocate_training_on_qwen25_1_5b_shapes(tmp_path, lora_backend):
    """Each backend in its own process: one colocated engine per process, as in training."""
    pytest.importorskip("vllm")
    import subprocess
    import sys

    from qerl_trl.study.runner import child_env

    env = {**child_env(os.environ, os.cpu_count() or 1), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, __file__, lora_backend, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=570, cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert "logprob check:" in proc.stdout


def _job(lora_backend: str, tmp_path) -> None:
    from triton import knobs

    from benchmarks import random_models as rm
    from benchmarks.colocate_check import lora_logprob_check, record_aqn_in_vllm
    from qerl_trl.aqn import AQNSchedule
    from qerl_trl.nvfp4 import NVFP4Linear
    from qerl_trl.vllm_plugin.single_lora import fp4_kernels_of
    from test_kernel_hooks import _forget_compiled_kernels

    path = rm.write_nvfp4_checkpoint(os.path.join(WORK, "1.5b-nvfp4"), "qwen2.5-1.5b", device="cuda", seed=0)
    trainer = _qerl_trainer(path, str(tmp_path / "out"), steps=3, lora_backend=lora_backend)
    gen = trainer.vllm_generation
    want = _expected_kernel()
    kernels = set(gen.llm.apply_model(fp4_kernels_of)[0].values())
    print(f"engine start {gen.engine_start_seconds:.1f} s, FP4 kernel {gen.serving.fp4_kernel}: {sorted(kernels)}")
    assert gen.serving.fp4_kernel == want, (gen.serving.fp4_kernel, want)
    # every 1.5B layer fits Humming: all on the chosen kernel
    assert kernels == {"humming"} if want == "humming" else all(k.startswith("marlin: ") for k in kernels), kernels
    # vLLM 0.24 activates its Triton JIT monitor at the end of the engine's warm-up: from here on Triton serializes
    # every compile for the hook. Forget our compiled kernels so that the training step compiles them under it.
    assert knobs.runtime.jit_post_compile_hook is not None, "vLLM's JIT monitor is not active: the test proves nothing"
    _forget_compiled_kernels()

    model = trainer.model
    packed = {n: m.weight_packed.detach().clone() for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(packed) == 28 * 7
    lora0 = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    rounds, stop_recording = record_aqn_in_vllm(trainer)
    trainer.train()
    stop_recording()

    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 3 and all(math.isfinite(h["loss"]) for h in steps), steps
    assert any(h.get("aqn/sigma", 0) > 0 for h in steps), "AQN never noised a rollout"
    schedule = AQNSchedule(1e-2, 1e-3, 3)
    noised = [r for r in rounds if r["stage"] > 0]
    assert noised, rounds
    for r in noised:  # the noise reached vLLM's (float32) norms at the scheduled σ
        want_sigma = schedule.sigma(r["step"], 3)
        assert abs(r["realized_std"] - want_sigma) <= AQN_REL_TOL * want_sigma, r
        assert r["vllm_norm_dtypes"] == ["torch.float32"], r
    guard = trainer._rollout_guard
    assert guard is not None and guard.last is not None and not guard.bad_rounds, (guard.last, guard.bad_rounds)
    moved = [n for n, p in model.named_parameters() if "lora_" in n and not torch.equal(p.detach(), lora0[n])]
    assert len(moved) > len(lora0) // 2, f"only {len(moved)} of {len(lora0)} LoRA tensors changed"
    for n, m in model.named_modules():
        if isinstance(m, NVFP4Linear):
            assert torch.equal(m.weight_packed, packed[n]), f"the packed base of {n} changed"
    lp = lora_logprob_check(trainer)
    print("logprob check:", json.dumps(lp))
    assert lp["match"] <= LOGPROB_TOL, lp
    assert lp["served"] >= SERVED_MIN, lp


if __name__ == "__main__":  # one backend's job in a fresh process (see the test)
    import pathlib
    import sys

    sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    _job(sys.argv[1], pathlib.Path(sys.argv[2]))
