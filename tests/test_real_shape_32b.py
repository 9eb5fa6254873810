"""The job users run, at the largest size we claim: a Qwen2.5-32B-shaped random model on one 80 GB GPU.

``pytest -m vllm`` on the GPU machine (its own ``scripts/gpu_suite.py`` part, after ``checkpoint_32b``, whose test
writes the 20 GiB checkpoint under ``$QERL_E2E_WORK``, 51 s at a29dbda; run alone, this part writes it first). Two
GRPO steps of 8 completions x 2048 tokens run with vLLM colocate, sleep mode, AQN and the default LoRA backend (in a
child process, through ``benchmarks/e2e_step.py``), and the peak device memory is recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.e2e_step import H100_80GB_GIB  # noqa: E402 - the repository root first

WORK = os.environ.get("QERL_E2E_WORK", "/tmp/qerl-e2e")
ARTIFACTS = os.environ.get("QERL_TEST_ARTIFACTS")  # where the test also writes its row (the GPU run's $OUT)
#: the step's own limit (e2e_step's per-row timeout: a slower step is a "timeout" row, and the test fails saying so)
#: inside the device's 10-minute call, so an over-long part is recorded rather than killed
STEP_TIMEOUT_S = 540


def _default_arm() -> str:
    """The e2e_step arm that serves the LoRA through QeRLGRPOConfig's default ``vllm_lora_backend``: the job users
    run (``"qerl"`` since d4c731d; the test ran the ``"vllm"`` backend before)."""
    from benchmarks.e2e_step import QERL_ARMS
    from qerl_trl import QeRLGRPOConfig

    default = QeRLGRPOConfig.__dataclass_fields__["vllm_lora_backend"].default
    return next(arm for arm, backend in QERL_ARMS.items() if backend == default)


def test_the_32b_step_runs_the_default_lora_backend():
    assert _default_arm() == "qerl_single_lora"


@pytest.mark.gpu
@pytest.mark.vllm
def test_qwen25_32b_step_fits_on_an_80gb_gpu(tmp_path):
    pytest.importorskip("vllm")
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if total < 75:
        pytest.skip(f"needs an 80 GB GPU, this one has {total:.0f} GiB")
    free_disk = __import__("shutil").disk_usage(os.path.dirname(WORK) or "/").free / 2**30
    if free_disk < 25 and not os.path.exists(os.path.join(WORK, "32b-nvfp4", "config.json")):
        pytest.skip(f"needs ~20 GiB of disk for the 32B NVFP4 checkpoint, {free_disk:.0f} GiB free")
    torch.cuda.empty_cache()  # the step runs in a child process; NVML counts the whole device
    out = os.path.join(ARTIFACTS or str(tmp_path), "e2e_step-32b-rows.jsonl")  # kept: a benchmark row too
    if os.path.exists(out):
        os.remove(out)
    # on a larger card (an H200), vLLM gets the GiB it would get on an 80 GB one: its KV cache is a share of the card
    # (85.5 GiB peak at 0.45 of an H200 at d251c46, against 58.5 on an H100 at 7f0ef85)
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "e2e_step.py"), "--sizes", "32b", "--arms", _default_arm(),
           "--steps", "2", "--timeout", str(STEP_TIMEOUT_S), "--work", WORK, "--out-dir", str(tmp_path),
           "--jsonl", str(out), "--card-gib", str(H100_80GB_GIB)]
    # the backstop allows for the checkpoint's write when this part runs alone
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S + 300)
    with open(out) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "_meta" not in r]
    assert rows, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = rows[-1]
    if ARTIFACTS:
        os.makedirs(ARTIFACTS, exist_ok=True)
        with open(os.path.join(ARTIFACTS, "qwen2.5-32b-memory.json"), "w") as f:
            json.dump(row, f, indent=1, default=str)
    print("32B row:", json.dumps({k: row.get(k) for k in ("status", "peak_gib", "torch_peak_gib", "step_s",
                                                           "vllm_gpu_memory_utilization")}))
    assert row["status"] == "ok", row.get("status", "") + row.get("traceback", "")[-2000:]
    # a real 80 GB card, and what a run on one would need: the peak stays under the card with room to spare
    assert row["peak_gib"] < min(total, 79.0), row["peak_gib"]
