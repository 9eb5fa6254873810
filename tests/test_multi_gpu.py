"""Two GPUs: ``tests/ddp_job.py`` under ``accelerate launch --num_processes 2`` (the examples' DDP config) with vLLM
colocate (one engine per rank, or one TP=2 engine) on the real SmolLM2-135M-Instruct, quantized to NVFP4 on load. Skips cleanly on a machine with fewer than 2 GPUs."""

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


@pytest.mark.parametrize("lora_backend", ["vllm", "qerl"])
def test_ddp_two_ranks_vllm_colocate(tmp_path, smollm2_checkpoints, lora_backend):
    smollm2_bf16 = smollm2_checkpoints[0]
    cache = tmp_path / "nvfp4-cache"  # empty: both ranks start together, the checkpoint must be written once
    common = ["--model", str(smollm2_bf16), "--use_vllm", "--cache_dir", str(cache), "--max_steps", "4",
              "--save_steps", "2", "--vllm_lora_backend", lora_backend]  # fmt: skip
    first = launch(tmp_path / "run", *common, timeout=900, cpu=False)
    assert len(list(cache.iterdir())) == 1
    aqn = {r: by_event(recs, "aqn") for r, recs in first.items()}
    lora = {r: by_event(recs, "lora") for r, recs in first.items()}
    assert aqn[0] == aqn[1] and [a["sigma"] for a in aqn[0]] == [0.0, 0.0, 1e-2, 1e-2]
    assert lora[0] == lora[1] and len({x["sha"] for x in lora[0]}) == 4
    for r in (0, 1):  # each rank's engine serves the synced adapter on the FP4 base (noise-free rounds)
        gaps = by_event(first[r], "gap")
        assert len(gaps) == 4 and all(g["nan_fraction"] == 0 for g in gaps), gaps
        assert all(g["gap"] < 0.15 for g in gaps[:2]), gaps
    resumed = launch(tmp_path / "resumed", *common, "--resume", str(tmp_path / "run" / "trainer" / "checkpoint-2"),
                     timeout=900, cpu=False)  # fmt: skip
    for r in (0, 1):
        assert by_event(resumed[r], "aqn") == aqn[r][2:]
        assert by_event(resumed[r], "done") == [{"event": "done", "global_step": 4, "max_steps": 4}]


@pytest.mark.parametrize("lora_backend", ["vllm", "qerl"])
def test_tensor_parallel_engine_serves_the_trained_lora(tmp_path, smollm2_checkpoints, lora_backend):
    """vllm_tensor_parallel_size=2: one engine sharded over both ranks. With lora_backend="qerl" every layer holds
    its shard of the LoRA (B rows for column-parallel layers, A columns for row-parallel ones, the partial LoRA added
    before the all-reduce): vLLM's log-probs must still match each rank's trainer on the noise-free rounds."""
    common = ["--model", str(smollm2_checkpoints[0]), "--use_vllm", "--cache_dir", str(tmp_path / "cache"),
              "--max_steps", "4", "--save_steps", "4", "--vllm_tensor_parallel_size", "2",
              "--vllm_lora_backend", lora_backend]  # fmt: skip
    run = launch(tmp_path / "tp2", *common, timeout=900, cpu=False)
    lora = {r: by_event(recs, "lora") for r, recs in run.items()}
    assert lora[0] == lora[1] and len(lora[0]) == 4
    for r in (0, 1):
        gaps = by_event(run[r], "gap")  # AQN: rounds 1-2 noise-free, 3-4 at σ = 1e-2
        assert len(gaps) == 4 and all(g["nan_fraction"] == 0 for g in gaps), (r, gaps)
        assert all(g["gap"] < 0.15 for g in gaps[:2]), (r, gaps)
