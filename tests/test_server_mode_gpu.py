"""Server mode on the GPU (issue #39): ``qerl-trl vllm-serve`` serves SmolLM2's NVFP4 base, ``tests/ddp_job.py``
trains against it with ``vllm_mode="server"`` (AQN on). On one GPU the server and the trainer share it (the sync
needs no NCCL group); with two, the server runs on the second. Checks: every round the server read the trainer's
file (or serves its newest adapter), vLLM's log-probs match the trainer's on the noise-free rounds, the FP4 base is
never written, and a trainer whose LoRA differs from what the server serves is refused before its first step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from benchmarks._child import free_port, visible_gpu
from test_ddp import by_event

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(params=["qerl", "vllm"])
def server(request, smollm2_checkpoints, tmp_path):
    """A running ``qerl-trl vllm-serve`` for SmolLM2's NVFP4A16 checkpoint and a rank-8 LoRA: ``(url, backend)``."""
    import requests

    backend = request.param
    port = free_port()
    second = torch.cuda.device_count() > 1
    gpu = visible_gpu(1 if second else 0)  # this process's GPU, also inside a GPU-suite lane
    cmd = [sys.executable, "-m", "qerl_trl.cli", "vllm-serve", str(smollm2_checkpoints[1]), "--lora-backend", backend,
           "--lora-r", "8", "--fp4-kernel", "marlin", "--host", "127.0.0.1", "--port", str(port),
           "--gpu-memory-utilization", "0.6" if second else "0.3", "--max-model-len", "512"]  # fmt: skip
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 400
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(2)
        else:
            pytest.fail("the server did not start in 400 s:\n" + (tmp_path / "server.log").read_text()[-4000:])
        yield url, backend
    finally:
        try:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:  # it had exited (the assertion above shows its log)
            pass
        log.close()


def _train(tmp_path, model: str, url: str, backend: str, *extra: str) -> tuple[int, dict[int, list], str]:
    out = tmp_path / "job"
    cmd = [sys.executable, os.path.join(REPO, "tests", "ddp_job.py"), "--model", model, "--out", str(out),
           "--use_vllm", "--vllm_mode", "server", "--server_url", url, "--vllm_lora_backend", backend,
           "--max_steps", "4", "--save_steps", "4", *extra]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible_gpu(0)}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "trainer.log", "w") as log:  # a file, not a pipe: a run cut off by its call's limit keeps it
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode
    records = {}
    if (out / "rank0.jsonl").exists():
        records[0] = [json.loads(line) for line in (out / "rank0.jsonl").read_text().splitlines()]
    return rc, records, (out / "trainer.log").read_text(errors="replace")[-8000:]


def test_training_against_the_server_serves_the_trained_lora_and_never_writes_the_base(server, smollm2_checkpoints,
                                                                                       tmp_path):  # fmt: skip
    url, backend = server
    rc, records, log = _train(tmp_path, str(smollm2_checkpoints[1]), url, backend)
    assert rc == 0, log
    run = records[0]
    syncs = by_event(run, "sync")
    assert len(syncs) == 4, log
    assert all((s["read_ok"] if backend == "qerl" else s["adapter_root_ok"]) for s in syncs), syncs
    base = {b["when"]: b["checksums"] for b in by_event(run, "base")}
    assert base["before"] and base["before"] == base["after"], base
    aqn = by_event(run, "aqn")
    assert [a["sigma"] for a in aqn] == [0.0, 0.0, 1e-2, 1e-2]
    assert len({x["sha"] for x in by_event(run, "lora")}) == 4  # the LoRA trained every step
    gaps = by_event(run, "gap")  # the served policy is the trained one: the colocate tolerance on noise-free rounds
    assert len(gaps) == 4 and all(g["nan_fraction"] == 0 for g in gaps), gaps
    assert all(g["gap"] < 0.15 for g in gaps[:2]), gaps
    assert by_event(run, "done") == [{"event": "done", "global_step": 4, "max_steps": 4}]

    # a trainer whose LoRA the server does not serve is refused before its first step, with the command to run
    rc, records, log = _train(tmp_path / "other", str(smollm2_checkpoints[1]), url, backend, "--lora_r", "16",
                              "--max_steps", "1")  # fmt: skip
    assert rc != 0 and "cannot serve this trainer's policy" in log and "qerl-trl vllm-serve" in log, log
    assert "--lora-r 16" in log and not records.get(0)
