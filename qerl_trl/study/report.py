"""The learning comparison's report: per-run metrics, a verdict per claim paired by seed, the summary and the plot.

Reads what :mod:`qerl_trl.study.runner` records (``runs/<run>.jsonl``); needs no GPU, so a study run elsewhere can be
reported here again (``benchmarks/learning.py --report_only``).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from .spec import STEP_KEYS, LearningConfig, RunSpec, read_records

__all__ = ["CLAIMS", "format_summary", "load_runs", "plot_curves", "run_metrics", "summarize", "verdict"]


def load_runs(work: Path, specs: list[RunSpec]) -> list[dict]:
    """One dict per run: its spec, status, per-step metrics (lists by step) and held-out evaluations."""
    runs = []
    for spec in specs:
        records = read_records(Path(work) / "runs" / f"{spec.name}.jsonl")
        end = next((r for r in reversed(records) if r.get("event") == "end"), None)
        steps = [r for r in records if r.get("event") == "step"]
        evals = [r for r in records if r.get("event") == "eval"]
        run: dict[str, Any] = {
            "name": spec.name, "arm": spec.arm, "seed": spec.seed, "learning_rate": spec.learning_rate,
            "status": end["status"] if end else ("running" if records else "not_run"),
        }  # fmt: skip
        if end and end.get("status") != "ok":
            run["error"] = end.get("error")
        if end:
            run.update({k: end[k] for k in ("init_s", "train_s") if k in end})
        run["steps"] = {"step": [r["step"] for r in steps]}
        for name in [*STEP_KEYS.values(), "wall_s", "prompts_sha"]:
            run["steps"][name] = [r.get(name) for r in steps]
        run["evals"] = {"step": [r["step"] for r in evals], "accuracy": [r["accuracy"] for r in evals]}
        earlier = earlier_attempts(Path(work) / "runs", spec.name)
        if earlier:
            run["earlier_attempts"] = earlier
        runs.append(run)
    return runs


def earlier_attempts(runs_dir: Path, name: str) -> list[dict]:
    """How the unfinished attempts of a run ended (the ``<run>.<time>.partial`` files a restart keeps), oldest
    first: a row that is ``ok`` on a retry says so, with the earlier attempt's failure."""
    out = []
    for path in sorted(runs_dir.glob(f"{name}.*.partial"), key=lambda p: int(p.suffixes[-2].lstrip("."))):
        records = read_records(path)
        end = next((r for r in reversed(records) if r.get("event") == "end"), None)
        out.append({
            "status": end["status"] if end else "killed", "stage": end.get("stage") if end else None,
            "steps": sum(r.get("event") == "step" for r in records), "error": end.get("error") if end else None,
        })  # fmt: skip
    return out


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def run_metrics(run: dict, max_steps: int, early_fraction: float) -> dict[str, float | None]:
    """The numbers each claim compares: early entropy, mean reward (all / first half), held-out accuracy."""
    s = run["steps"]
    early = max(1, round(early_fraction * max_steps))
    by_step = dict(zip(s["step"], range(len(s["step"])), strict=True))

    def over(name: str, lo: int, hi: int):
        return _mean([s[name][by_step[k]] for k in range(lo, hi + 1) if k in by_step])

    evals = run["evals"]
    return {
        "early_entropy": over("entropy", 1, early),
        "mean_reward": over("reward", 1, max_steps),
        "mean_reward_first_half": over("reward", 1, max_steps // 2),
        "reward_last_10pct": over("reward", max_steps - max(1, max_steps // 10) + 1, max_steps),
        "initial_accuracy": evals["accuracy"][0] if evals["accuracy"] and evals["step"][0] == 0 else None,
        "final_accuracy": evals["accuracy"][-1] if evals["step"] and evals["step"][-1] == max_steps else None,
    }


#: (claim, metric, arm, baseline arm): arm - baseline, paired by seed, should be > 0 (>= 0 for "at least").
CLAIMS = (
    ("fp4_raises_early_entropy", "early_entropy", "nvfp4_lora", "bf16_lora"),
    ("fp4_raises_early_entropy", "early_entropy", "nvfp4_lora_aqn", "bf16_lora"),
    ("aqn_speeds_reward_growth", "mean_reward", "nvfp4_lora_aqn", "nvfp4_lora"),
    ("aqn_speeds_reward_growth", "mean_reward", "nvfp4_lora_aqn", "bf16_lora"),
    ("aqn_speeds_reward_growth", "mean_reward_first_half", "nvfp4_lora_aqn", "nvfp4_lora"),
    ("final_accuracy_at_least_bf16", "final_accuracy", "nvfp4_lora_aqn", "bf16_lora"),
    ("final_accuracy_at_least_bf16", "final_accuracy", "nvfp4_lora", "bf16_lora"),
)


def verdict(diffs: list[float], at_least: bool = False) -> str:
    """Paired differences (arm - baseline, one per seed) -> a verdict that names its consistency over seeds.

    With a handful of seeds a mean alone overclaims (one seed can carry it), so the verdict counts seeds."""
    if not diffs:
        return "not measured"
    if len(diffs) < 2:
        return "one seed only: no verdict"
    ok = [d >= 0 if at_least else d > 0 for d in diffs]
    if all(ok):
        return "holds on every seed"
    if not any(ok):
        return "does not hold on any seed"
    return f"mixed: holds on {sum(ok)} of {len(ok)} seeds"


def summarize(runs: list[dict], cfg: LearningConfig) -> dict:
    """Per learning rate: each arm's metrics (mean, std over seeds) and each claim's paired verdict."""
    out: dict[str, Any] = {}
    for lr in cfg.learning_rates:
        ok = {(r["arm"], r["seed"]): run_metrics(r, cfg.max_steps, cfg.early_fraction)
              for r in runs if r["learning_rate"] == lr and r["status"] == "ok"}  # fmt: skip
        arms: dict[str, Any] = {}
        for arm in cfg.arms:
            per_seed = {seed: m for (a, seed), m in ok.items() if a == arm}
            metrics: dict[str, Any] = {"seeds": sorted(per_seed)}
            for key in ("early_entropy", "mean_reward", "mean_reward_first_half", "reward_last_10pct",
                        "initial_accuracy", "final_accuracy"):  # fmt: skip
                vals = [m[key] for m in per_seed.values() if m[key] is not None]
                metrics[key] = _spread(vals)
            arms[arm] = metrics
        claims = []
        for claim, metric, arm, base in CLAIMS:
            if arm not in cfg.arms or base not in cfg.arms:
                continue
            pairs = [(s, ok[(arm, s)][metric], ok[(base, s)][metric]) for s in cfg.seeds
                     if (arm, s) in ok and (base, s) in ok]  # fmt: skip
            diffs = [a - b for _, a, b in pairs if a is not None and b is not None]
            claims.append({
                "claim": claim, "metric": metric, "comparison": f"{arm} - {base}",
                "per_seed": {s: round(a - b, 4) for s, a, b in pairs if a is not None and b is not None},
                **_spread(diffs), "verdict": verdict(diffs, at_least=claim.endswith("at_least_bf16")),
            })  # fmt: skip
        same_order = {}
        for seed in cfg.seeds:
            orders = [r["steps"]["prompts_sha"] for r in runs
                      if r["learning_rate"] == lr and r["seed"] == seed and r["status"] == "ok"]  # fmt: skip
            same_order[seed] = all(o == orders[0] and None not in o for o in orders) if len(orders) > 1 else None
        out[f"{lr:g}"] = {"arms": arms, "claims": claims, "same_data_order": same_order}
    return out


def _spread(vals: list[float]) -> dict[str, float | int | None]:
    if not vals:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": round(sum(vals) / len(vals), 4), "std": round(statistics.stdev(vals), 4) if len(vals) > 1 else 0.0,
            "n": len(vals)}  # fmt: skip


def format_summary(summary: dict) -> str:
    lines = []
    for lr, block in summary.items():
        lines.append(f"== learning rate {lr} ==")
        for arm, m in block["arms"].items():
            def f(k):
                x = m[k]
                return "n/a" if x["mean"] is None else f"{x['mean']:.3f}±{x['std']:.3f}"

            lines.append(f"  {arm:16s} seeds {m['seeds']}  early entropy {f('early_entropy')}  mean reward "
                         f"{f('mean_reward')}  held-out acc {f('initial_accuracy')} -> {f('final_accuracy')}")  # fmt: skip
        lines.append(f"  same prompts in the same order across arms, by seed: {block['same_data_order']}")
        for c in block["claims"]:
            mean = "n/a" if c["mean"] is None else f"{c['mean']:+.4f}±{c['std']:.4f}"
            lines.append(f"  {c['claim']}: {c['metric']} {c['comparison']} = {mean} -> {c['verdict']}")
    return "\n".join(lines)


def _running_mean(xs: list[float | None], window: int) -> list[float]:
    out, vals = [], []
    for x in xs:
        vals.append(float("nan") if x is None else x)
        tail = [v for v in vals[-window:] if not math.isnan(v)]
        out.append(sum(tail) / len(tail) if tail else float("nan"))
    return out


def plot_curves(runs: list[dict], path: Path, cfg: LearningConfig, window: int = 10) -> Path:
    """Reward, entropy (running means over ``window`` steps) and held-out accuracy per arm: mean over the seeds
    that finished, shaded from the lowest to the highest seed; one row per learning rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"bf16_lora": "tab:blue", "nvfp4_lora": "tab:orange", "nvfp4_lora_aqn": "tab:green"}
    lrs = cfg.learning_rates
    fig, axes = plt.subplots(len(lrs), 3, figsize=(15, 3.8 * len(lrs)), squeeze=False)
    for row, lr in zip(axes, lrs, strict=True):
        for arm in cfg.arms:
            mine = [r for r in runs if r["arm"] == arm and r["learning_rate"] == lr and r["status"] == "ok"]
            if not mine:
                continue
            label = f"{arm} ({len(mine)} seeds)"
            for ax, key in ((row[0], "reward"), (row[1], "entropy")):
                curves = {}
                for r in mine:
                    for st, v in zip(r["steps"]["step"], _running_mean(r["steps"][key], window), strict=True):
                        curves.setdefault(st, []).append(v)
                xs = sorted(curves)
                ax.plot(xs, [statistics.fmean(curves[x]) for x in xs], color=colours[arm], label=label)
                ax.fill_between(xs, [min(curves[x]) for x in xs], [max(curves[x]) for x in xs], color=colours[arm],
                                alpha=0.18, lw=0)  # fmt: skip
            accs = {}
            for r in mine:
                for st, a in zip(r["evals"]["step"], r["evals"]["accuracy"], strict=True):
                    accs.setdefault(st, []).append(a)
            xs = sorted(accs)
            row[2].errorbar(xs, [statistics.fmean(accs[x]) for x in xs],
                            yerr=[[statistics.fmean(accs[x]) - min(accs[x]) for x in xs],
                                  [max(accs[x]) - statistics.fmean(accs[x]) for x in xs]],
                            color=colours[arm], marker="o", ms=4, capsize=3, label=label)  # fmt: skip
        row[0].set(title=f"training reward (running mean of {window} steps), lr {lr:g}", xlabel="step")
        row[1].set(title=f"policy entropy, nats/token (running mean of {window})", xlabel="step")
        row[2].set(title="held-out accuracy (greedy)", xlabel="step", ylim=(-0.02, 1.02))
        row[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("mean over seeds; shading and bars span the lowest to the highest seed", fontsize=9, y=0.995)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
