"""The job users run, at real shapes: QeRLGRPOTrainer with vLLM colocate on a Qwen2.5-shaped random model.

``pytest -m vllm`` on the GPU machine (vLLM, TRL and datasets from the GPU bundle). Checkpoints are written once per
machine under ``$QERL_E2E_WORK`` (default ``/tmp/qerl-e2e``, shared with ``benchmarks/e2e_step.py``).

1.5B shapes, every kernel path enabled, AQN on, sleep mode level 1, 3 steps: vLLM's JIT monitor is active when
  training starts and our kernels compile under it (the crash at f675bcc), the loss is finite, the LoRA moves, the
  packed base does not, and after a sync vLLM's log-probs of a fixed completion match the trainer's.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

WORK = os.environ.get("QERL_E2E_WORK", "/tmp/qerl-e2e")
LOGPROB_TOL = 0.05  # mean |Δ log p| per token, vLLM (Marlin FP4 + LoRA) vs the trainer (as benchmarks/colocate_check)
SERVED_MIN = 5 * LOGPROB_TOL


def _qerl_trainer(path: str, out: str, steps: int):
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
    )

    def reward(completions, **kw):
        return [float(sum(map(ord, c)) % 97) / 97 for c in completions]

    return QeRLGRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict(
        {"prompt": prompts}), processing_class=tok)


def test_colocate_training_on_qwen25_1_5b_shapes(tmp_path):
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from triton import knobs

    from benchmarks import random_models as rm
    from benchmarks.colocate_check import lora_logprob_check
    from qerl_trl.nvfp4 import NVFP4Linear
    from test_kernel_hooks import _forget_compiled_kernels

    path = rm.write_nvfp4_checkpoint(os.path.join(WORK, "1.5b-nvfp4"), "qwen2.5-1.5b", device="cuda", seed=0)
    trainer = _qerl_trainer(path, str(tmp_path / "out"), steps=3)
    # vLLM 0.24 activates its Triton JIT monitor at the end of the engine's warm-up: from here on Triton serializes
    # every compile for the hook. Forget our compiled kernels so that the training step compiles them under it.
    assert knobs.runtime.jit_post_compile_hook is not None, "vLLM's JIT monitor is not active: the test proves nothing"
    _forget_compiled_kernels()

    model = trainer.model
    packed = {n: m.weight_packed.detach().clone() for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(packed) == 28 * 7
    lora0 = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    trainer.train()

    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 3 and all(math.isfinite(h["loss"]) for h in steps), steps
    assert any(h.get("aqn/sigma", 0) > 0 for h in steps), "AQN never noised a rollout"
    moved = [n for n, p in model.named_parameters() if "lora_" in n and not torch.equal(p.detach(), lora0[n])]
    assert len(moved) > len(lora0) // 2, f"only {len(moved)} of {len(lora0)} LoRA tensors changed"
    for n, m in model.named_modules():
        if isinstance(m, NVFP4Linear):
            assert torch.equal(m.weight_packed, packed[n]), f"the packed base of {n} changed"
    lp = lora_logprob_check(trainer)
    print("logprob check:", json.dumps(lp))
    assert lp["match"] <= LOGPROB_TOL, lp
    assert lp["served"] >= SERVED_MIN, lp
