"""Two GPUs, one tensor-parallel engine: ``tests/ddp_job.py`` under ``accelerate launch --num_processes 2`` with
``vllm_tensor_parallel_size=2`` (TRL's TP group: both ranks' prompts go to one engine sharded over the two GPUs), on
random NVFP4A16 weights at Qwen2.5-1.5B's layer shapes. Skips cleanly on a machine with fewer than 2 GPUs."""

from __future__ import annotations

import pytest
import torch

from test_ddp import by_event, launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.multi_gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def tensor_parallel_config():
    """Qwen2.5-1.5B's layer shapes cut to 4 layers: 12 attention heads and 2 KV heads split over 2 ranks, and each
    rank's MLP share (4480) is whole NVFP4 groups. SmolLM2-135M cannot serve at TP=2 (9 heads): vLLM refused it on
    the first 2-GPU run, and the trainer now refuses it before loading (``parallel_rules``)."""
    from benchmarks import random_models as rm

    return rm.qwen25_config("qwen2.5-1.5b", num_hidden_layers=4)


@pytest.mark.parametrize("lora_backend", ["vllm", "qerl"])
def test_tensor_parallel_engine_serves_the_trained_lora(tmp_path, lora_backend):
    """vllm_tensor_parallel_size=2: one engine sharded over both ranks, on an NVFP4A16 checkpoint of random weights at
    real layer shapes. With lora_backend="qerl" every layer holds its shard of the LoRA (B rows for column-parallel
    layers, A columns for row-parallel ones, the partial LoRA added before the all-reduce): vLLM's log-probs must still
    match each rank's trainer on the noise-free rounds. Marlin: Humming's first compile would take minutes per
    engine (its TP=1 layers are covered by ``test_single_lora_vllm.py``)."""
    from benchmarks import random_models as rm

    model = rm.write_nvfp4_checkpoint(str(tmp_path / "model"), tensor_parallel_config(), device="cuda", seed=0)
    common = ["--model", model, "--use_vllm", "--max_steps", "4", "--save_steps", "4", "--vllm_tensor_parallel_size",
              "2", "--vllm_lora_backend", lora_backend, "--vllm_fp4_kernel", "marlin"]  # fmt: skip
    run = launch(tmp_path / "tp2", *common, timeout=900, cpu=False)
    lora = {r: by_event(recs, "lora") for r, recs in run.items()}
    assert lora[0] == lora[1] and len(lora[0]) == 4
    for r in (0, 1):
        gaps = by_event(run[r], "gap")  # AQN: rounds 1-2 noise-free, 3-4 at σ = 1e-2
        assert len(gaps) == 4 and all(g["nan_fraction"] == 0 for g in gaps), (r, gaps)
        assert all(g["gap"] < 0.15 for g in gaps[:2]), (r, gaps)
