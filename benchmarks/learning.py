"""Learning dynamics on a real model: BF16 LoRA vs NVFP4 LoRA vs NVFP4 LoRA + AQN (issue #16).

Runs :func:`qerl_trl.study.runner.run_comparison` (the ``qerl-trl compare`` command) with the study's settings and
writes ``benchmarks/results/learning-<gpu>.json`` (one row per run: its per-step reward, entropy, completion
length, AQN σ and wall time, and its held-out accuracy at each evaluation; plus the per-claim summary) and
``learning-<gpu>.png`` (reward and entropy per step, mean over seeds with their spread, one colour per arm).

    python benchmarks/learning.py --output_dir /tmp/learning --parallel 9          # on the GPU machine
    python benchmarks/learning.py --output_dir /tmp/learning --report_only         # rewrite the JSON from runs

Every ``LearningConfig`` option is a flag (``qerl-trl compare --help-options``). Finished runs are skipped, so a
study cut off by a time limit continues where it stopped when the same command runs again.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import REPO, gpu_tag, result_envelope  # noqa: E402


@dataclass
class ReportArgs:
    results_dir: str = field(default=os.path.join(REPO, "benchmarks", "results"), metadata={"help": "Where the JSON goes."})
    report_only: bool = field(default=False, metadata={"help": "Do not train: report the runs already in output_dir."})
    invalid: list[str] = field(
        default_factory=list,
        metadata={"help": "RUN_PREFIX=REASON: mark the runs whose name starts with RUN_PREFIX invalid (kept as rows "
                  "with the reason, left out of the summary and the plot). --report_only only."},
    )
    envelope_from: str | None = field(
        default=None,
        metadata={"help": "A learning-<gpu>.json written on the GPU machine: keep its gpu, versions, commit and "
                  "command (the runs' provenance) when the report is rewritten elsewhere. --report_only only."},
    )


def mark_invalid(runs: list[dict], marks: list[str]) -> None:
    """Apply ``RUN_PREFIX=REASON`` marks: status ``invalid`` and the reason as the row's error."""
    for mark in marks:
        prefix, sep, reason = mark.partition("=")
        hit = [r for r in runs if r["name"].startswith(prefix)]
        if not sep or not reason or not hit:
            raise SystemExit(f"--invalid {mark!r}: need RUN_PREFIX=REASON naming at least one run")
        for r in hit:
            r["status"], r["error"] = "invalid", reason


def main(argv: list[str] | None = None) -> str:
    from transformers import HfArgumentParser

    from qerl_trl.study.report import format_summary, load_runs, plot_curves, summarize
    from qerl_trl.study.runner import run_comparison, run_specs
    from qerl_trl.study.spec import LearningConfig

    parser = HfArgumentParser((LearningConfig, ReportArgs))
    cfg, rep = parser.parse_args_into_dataclasses(args=argv)
    if (rep.invalid or rep.envelope_from) and not rep.report_only:
        parser.error("--invalid and --envelope_from go with --report_only")
    if rep.report_only:
        work = Path(cfg.output_dir).resolve()
        runs = load_runs(work, run_specs(cfg, "", ""))
        mark_invalid(runs, rep.invalid)
        summary = summarize(runs, cfg)
        plot = plot_curves(runs, work / "learning_curves.png", cfg)
        print(format_summary(summary))
    else:
        result = run_comparison(cfg)
        runs, summary, plot = result["runs"], result["summary"], result["plot"]
    envelope = result_envelope("learning", runs, "python benchmarks/learning.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    name = f"learning-{gpu_tag()}.json"
    if rep.envelope_from:
        with open(rep.envelope_from) as f:
            source = json.load(f)
        envelope["report"] = {"commit": envelope["commit"], "command": envelope["command"]}
        envelope.update({k: source[k] for k in ("gpu", "versions", "commit", "command")})
        name = os.path.basename(rep.envelope_from)
    envelope["config"] = asdict(cfg)
    envelope["summary"] = summary
    os.makedirs(rep.results_dir, exist_ok=True)
    path = os.path.join(rep.results_dir, name)
    with open(path, "w") as f:
        json.dump(envelope, f, indent=1, default=str)
    png = path.removesuffix(".json") + ".png"
    shutil.copyfile(plot, png)
    print(f"wrote {path} and {png}")
    return path


if __name__ == "__main__":
    main()
