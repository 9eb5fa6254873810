"""GPU + vLLM: the colocate run of benchmarks/colocate_check.py must pass every check (see that script), for each
way of serving the LoRA. Each runs in its own process: one colocated engine per process, as in training."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("lora_backend,extra", [("vllm", []), ("qerl", []),
                                                ("vllm", ["--lora_sync_files", "--sleep"]),
                                                ("qerl", ["--fused_importance_sampling", "--sleep"])],
                         ids=["vllm", "qerl", "vllm_files_sleep", "qerl_fused_is_sleep"])  # fmt: skip
def test_colocate_vllm_lora_aqn_fp4_kernel(tmp_path, smollm2_gguf, lora_backend, extra):
    """Every check of colocate_check, per LoRA backend as shipped (``gpu_suite.py colocate``; the "vllm" backend
    refreshes the loaded adapter in place after the first round, and the log-prob match after the check's own sync
    of a perturbed LoRA says the refresh landed), then the options off the default path (``colocate_variants``),
    with sleep mode on: the "vllm" backend loading every round's adapter from files
    (``vllm_lora_sync_in_place=False``), and the importance-sampling ratio from the training forward
    (``fused_importance_sampling``: the IS-ratio check reads its metrics)."""
    out = tmp_path / "rows.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "colocate_check.py"), "--gguf", smollm2_gguf,
           "--work", str(tmp_path), "--steps", "6", "--lora_backend", lora_backend, "--out", str(out),
           *extra]  # fmt: skip
    from qerl_trl.study.runner import child_env

    # a fresh single-process job, whatever this process ran before (no inherited torch.distributed rendezvous)
    env = {**child_env(os.environ, os.cpu_count() or 1), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = json.loads(out.read_text())["rows"]
    print("\n".join(json.dumps({k: r.get(k) for k in ("check", "value", "ok")}, default=str) for r in rows))
    bad = [r for r in rows if r["ok"] is False]
    assert not bad, bad
    checks = {r["check"].removeprefix("sleep1/") for r in rows}  # --sleep names its rows sleep1/<check>
    assert {"aqn_absent_stage0", "aqn_sigma_in_vllm", "fp4_kernel", "is_ratio_mean",
            "lora_logprob_match_vllm_vs_trainer", "lora_served_vllm_lora_vs_base"} <= checks
    assert proc.returncode == 0, proc.stderr[-3000:]
