"""GPU + vLLM: the colocate run of benchmarks/colocate_check.py must pass every check (see that script)."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


def test_colocate_vllm_lora_aqn_marlin(tmp_path, smollm2_gguf):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from benchmarks.colocate_check import run_check

    rows = run_check(smollm2_gguf, str(tmp_path), max_steps=6)
    bad = [r for r in rows if r["ok"] is False]
    assert not bad, bad
    checks = {r["check"] for r in rows}
    assert {"aqn_absent_stage0", "aqn_sigma_in_vllm", "marlin_nvfp4_kernel", "is_ratio_mean",
            "lora_logprob_match_vllm_vs_trainer", "lora_served_vllm_lora_vs_base"} <= checks
