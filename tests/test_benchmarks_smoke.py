"""CPU smoke runs of the benchmark scripts (the real numbers come from the GPU machine)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def test_memory_benchmark_runs_on_cpu(tmp_path):
    from benchmarks import memory

    env = memory.main(["--device", "cpu", "--tiny", "--layers", "1", "--seq", "16", "--rank", "8",
                       "--out-dir", str(tmp_path)])
    written = json.loads((tmp_path / "memory-cpu.json").read_text())
    assert written == json.loads(json.dumps(env))
    assert set(written) == {"benchmark", "gpu", "versions", "commit", "command", "rows"}
    assert written["benchmark"] == "memory" and {"torch", "transformers", "peft"} <= set(written["versions"])
    rows = {r["config"]: r for r in written["rows"]}
    assert set(rows) == {"bf16", "nvfp4"}
    assert rows["bf16"]["bytes_per_quantized_weight"] == 2.0
    assert 0.5625 < rows["nvfp4"]["bytes_per_quantized_weight"] <= 0.5625 + 4 / (64 * 128)
    assert rows["nvfp4"]["saved_tensors_mib_minus_bf16"] < rows["nvfp4"]["smallest_dense_weight_mib"]
    assert all("fwd_bwd_peak_gib" in r for r in rows.values())


def test_moe_expert_pass_benchmark_runs_every_arm_on_cpu(tmp_path):
    """The four arms compute one layer's experts: BF16's two implementations agree, NVFP4's two agree, and NVFP4 is
    off BF16 by its rounding of the weights only."""
    from benchmarks import moe_expert_pass as mep

    path = mep.main(["--device", "cpu", "--tokens", "24", "--experts", "4", "--hidden", "64", "--width", "32",
                     "--top-k", "2", "--repeats", "2", "--warmup", "1", "--out-dir", str(tmp_path)])  # fmt: skip
    written = json.loads(open(path).read())
    assert written["benchmark"] == "moe_expert_pass" and path.endswith("moe_expert_pass-cpu.json")
    rows = {r["arm"]: r for r in written["rows"]}
    assert set(rows) == set(mep.ARMS) and all(r["status"] == "ok" and r["fwd_bwd_ms"] > 0 for r in rows.values())
    assert rows["bf16_grouped_mm"]["rel_err"] == 0 and rows["bf16_eager"]["rel_err"] < 1e-2
    assert abs(rows["nvfp4_grouped"]["rel_err"] - rows["nvfp4_loop"]["rel_err"]) < 1e-2
    assert 0 < rows["nvfp4_grouped"]["rel_err"] < 0.2


def test_every_measured_row_of_the_committed_results_names_its_commit():
    """A result file's rows may come from several runs and commits (merges), so each measured row names its own;
    rows that record a configuration not run (``not_run: ...``) need not."""
    import glob

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "results")
    missing = {}
    for path in sorted(glob.glob(os.path.join(root, "*.json"))):
        with open(path) as f:
            rows = json.load(f)["rows"]
        bad = [r for r in rows if not r.get("commit") and not str(r.get("status", "")).startswith("not_run")]
        if bad:
            missing[os.path.basename(path)] = len(bad)
    assert not missing, f"rows without a commit: {missing}"


def test_a_result_file_stamps_rows_without_a_commit_with_its_own(monkeypatch):
    """e2e_step.py's rows came back without a commit each (the envelope had it): a later merge would lose it."""
    from benchmarks import _common

    monkeypatch.setenv("QERL_COMMIT", "a" * 40)
    env = _common.result_envelope("x", [{"arm": "a"}, {"arm": "b", "commit": "b" * 40}], "cmd")
    assert env["commit"] == "a" * 40
    assert [r["commit"] for r in env["rows"]] == ["a" * 40, "b" * 40]
