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

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

WORK = os.environ.get("QERL_E2E_WORK", "/tmp/qerl-e2e")


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
    from colocate_job import run_job_in_child

    run_job_in_child(__file__, lora_backend, tmp_path)


def _job(lora_backend: str, tmp_path) -> None:
    from triton import knobs

    from benchmarks import random_models as rm
    from colocate_job import train_and_check
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

    packed, _ = train_and_check(trainer, NVFP4Linear, "weight_packed", (1e-2, 1e-3, 3))
    assert len(packed) == 28 * 7


if __name__ == "__main__":  # one backend's job in a fresh process (see the test)
    from colocate_job import main

    main(_job)
