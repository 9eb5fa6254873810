"""The CPU demo (``qerl-trl demo``) on a CPU with native bf16 and on one without, each in its own process.

    python benchmarks/demo_cpu.py [--out-dir benchmarks/results]        # -> demo_cpu-cpu.json

Why: README gives the demo's time and held-out accuracy, and they must hold on both kinds of CPU (issue #40). A
CPU without native bf16 (AVX-512 without AVX512-BF16 or AMX) is emulated on one that has it by capping oneDNN's
ISA (``ONEDNN_MAX_CPU_ISA=AVX512_CORE``): PyTorch's CPU matmuls go through oneDNN, which then converts bf16 in
software, as it does on such a CPU (a bf16 matmul of the demo's shapes: 1.1 ms native, 6.7 ms capped; fp32 2.6-3.1
ms either way). The demo reads the same cap (``demo.cpu_has_native_bf16``).

Settings (rows ``{setting, cpu, dtype, steps, train_s, s_per_step, heldout_before, heldout_after,
reward_first_quarter, reward_last_quarter, status}``):

* ``native``: as is, ``--dtype auto`` (bf16 here);
* ``no_bf16``: the cap, ``--dtype auto`` (float32: what the demo picks on such a CPU);
* ``no_bf16_forced_bf16``: the cap and ``--dtype bfloat16`` (what the demo did before it picked), a few steps.

The SmolLM2 checkpoints are prepared (and cached) before the timed runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SETTINGS = {
    "native": ({}, ["--dtype", "auto"]),
    "no_bf16": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, ["--dtype", "auto"]),
    "no_bf16_forced_bf16": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, ["--dtype", "bfloat16"]),
}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def run(setting: str, steps: int | None, work: str) -> dict:
    env_extra, flags = SETTINGS[setting]
    out = os.path.join(work, setting)
    cmd = [sys.executable, "-m", "qerl_trl.cli", "demo", "--output-dir", out, *flags]
    if steps:
        cmd += ["--steps", str(steps), "--eval-size", "8"]
    env = {**os.environ, "TRITON_INTERPRET": "1", "TOKENIZERS_PARALLELISM": "false", **env_extra}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    row = {"setting": setting, "env": env_extra, "flags": flags + (["--steps", str(steps)] if steps else []),
           "wall_s": round(time.time() - t0, 1)}  # fmt: skip
    if proc.returncode != 0:
        return {**row, "status": f"failed (rc {proc.returncode})", "log_tail": proc.stderr[-2000:]}
    s = json.load(open(os.path.join(out, "summary.json")))
    return {**row, "status": "ok", "dtype": s["compute_dtype"], "steps": s["steps"], "train_s": s["train_seconds"],
            "s_per_step": round(s["train_seconds"] / s["steps"], 2), "heldout_before": s["heldout_accuracy_before"],
            "heldout_after": s["heldout_accuracy_after"], "eval_size": 8 if steps else 64,
            "reward_first_quarter": s["train_reward_first_quarter"], "reward_last_quarter": s["train_reward_last_quarter"]}  # fmt: skip


def main() -> None:
    from benchmarks._common import git_commit, write_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--forced-steps", type=int, default=3, help="steps of the no_bf16_forced_bf16 setting")
    ap.add_argument("--work", default="/tmp/qerl-demo-cpu")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    a = ap.parse_args()
    from qerl_trl.demo import prepare_model

    prepare_model()  # cached: the runs below time training, not the conversion
    rows = []
    for setting in a.settings:
        row = run(setting, a.forced_steps if setting == "no_bf16_forced_bf16" else None, a.work)
        row["cpu"] = f"{cpu_model()}, {os.cpu_count()} cores"
        row["commit"] = git_commit()
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("wrote", write_result("demo_cpu", rows, a.out_dir))


if __name__ == "__main__":
    main()
