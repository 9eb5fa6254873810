"""Learning dynamics on a real model: BF16 LoRA vs NVFP4 LoRA vs NVFP4 LoRA + AQN (issue #16).

Runs :func:`qerl_trl.learning.run_comparison` (the ``qerl-trl compare`` command) with the study's settings and
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

from _common import REPO, gpu_tag, write_result  # noqa: E402


@dataclass
class ReportArgs:
    results_dir: str = field(default=os.path.join(REPO, "benchmarks", "results"), metadata={"help": "Where the JSON goes."})
    report_only: bool = field(default=False, metadata={"help": "Do not train: report the runs already in output_dir."})


def main(argv: list[str] | None = None) -> str:
    from transformers import HfArgumentParser

    from qerl_trl.learning import LearningConfig, format_summary, load_runs, plot_curves, run_comparison, summarize

    parser = HfArgumentParser((LearningConfig, ReportArgs))
    cfg, rep = parser.parse_args_into_dataclasses(args=argv)
    if rep.report_only:
        from qerl_trl.learning import resolve_models, run_specs

        work = Path(cfg.output_dir).resolve()
        bf16, nvfp4 = resolve_models(cfg, work)
        runs = load_runs(work, run_specs(cfg, bf16, nvfp4))
        summary = summarize(runs, cfg)
        plot = plot_curves(runs, work / "learning_curves.png", cfg)
        print(format_summary(summary))
    else:
        result = run_comparison(cfg)
        runs, summary, plot = result["runs"], result["summary"], result["plot"]
    path = write_result("learning", runs, rep.results_dir)
    with open(path) as f:
        envelope = json.load(f)
    envelope["config"] = asdict(cfg)
    envelope["summary"] = summary
    with open(path, "w") as f:
        json.dump(envelope, f, indent=1, default=str)
    png = os.path.join(rep.results_dir, f"learning-{gpu_tag()}.png")
    shutil.copyfile(plot, png)
    print(f"wrote {path} and {png}")
    return path


if __name__ == "__main__":
    main()
