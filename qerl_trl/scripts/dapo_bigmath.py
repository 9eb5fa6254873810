"""DAPO on BigMath with QeRL: NVFP4 base + BF16 LoRA + Adaptive Quantization Noise (the paper's BigMath setting).

Shipped in the package so that ``qerl-trl train`` runs it from a plain ``pip install``; ``examples/dapo_bigmath.py``
is the same script's entry point in a source checkout.

DAPO in TRL is GRPO with ``loss_type: dapo``, ``beta: 0.0``, clip-higher (``epsilon_high: 0.28``) and
``mask_truncated_completions: true`` — all set in the ``*_bigmath.yaml`` recipes.

One GPU:

    accelerate launch --config_file examples/accelerate_configs/single_gpu.yaml \\
        examples/dapo_bigmath.py --config examples/recipes/qwen2.5-7b_bigmath.yaml

Several GPUs on one host (DDP):

    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml --num_processes 8 \\
        examples/dapo_bigmath.py --config examples/recipes/qwen2.5-32b_bigmath.yaml

The dataset is ``open-r1/Big-Math-RL-Verified-Processed`` (config ``level_3_4_5``, as in the paper) with columns
``prompt`` (the problem) and ``solution`` (the reference answer). ``--dataset_name`` also takes a local
``.json``/``.jsonl``/``.parquet``/``.csv`` file or directory with those columns (or GSM8K's ``question`` and
``answer``, whose ``#### N`` answers are understood too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ScriptArguments, TrlParser

from ..trainer import QeRLGRPOConfig
from .inputs import load_train_split
from .training import train_and_save

SYSTEM_PROMPT = (
    "Solve the following math problem step by step. Put the final answer within \\boxed{}, "
    "for example: \\boxed{42}"
)


@dataclass
class BigMathScriptArguments(ScriptArguments):
    """Script arguments for QeRL DAPO on BigMath (TRL's `ScriptArguments` plus prompt and reward options).

    Args:
        model_name_or_path: a 16-bit checkpoint (quantized to NVFP4 on load) or an NVFP4A16 one.
        system_prompt: system message put before each problem; empty string for none.
        reward_funcs: reward functions from `qerl_trl.rewards` (by name) or dotted import paths.
        max_prompt_chars: drop problems longer than this many characters (the paper keeps <= 1024).
        max_train_samples: keep only the first N training examples (quick runs).
    """

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model id or path: a 16-bit checkpoint or an NVFP4A16 one."}
    )
    dataset_name: str | None = field(
        default="open-r1/Big-Math-RL-Verified-Processed",
        metadata={"help": "Hub dataset id, or a local .json/.jsonl/.parquet/.csv file or directory."},
    )
    dataset_config: str | None = field(default="level_3_4_5", metadata={"help": "Dataset configuration name."})
    system_prompt: str = field(default=SYSTEM_PROMPT, metadata={"help": "System prompt ('' for none)."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["boxed_accuracy_reward"],
        metadata={"help": "Reward functions: names in qerl_trl.rewards or dotted import paths."},
    )
    max_prompt_chars: int = field(default=1024, metadata={"help": "Drop problems longer than this (characters)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N examples."})


def make_bigmath_prompts(dataset, system_prompt: str, max_prompt_chars: int):
    """Map BigMath rows (``prompt``/``solution``; GSM8K's ``question``/``answer`` also accepted) to chat prompts."""
    cols = set(dataset.column_names)
    if {"question", "answer"} <= cols and "prompt" not in cols:
        dataset = dataset.rename_columns({"question": "prompt", "answer": "solution"})
    elif not {"prompt", "solution"} <= cols:
        raise ValueError(f"BigMath data needs columns 'prompt' and 'solution'; got {sorted(cols)}.")
    dataset = dataset.filter(lambda x: len(x["prompt"]) <= max_prompt_chars)

    def to_prompt(example):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": example["prompt"]})
        return {"prompt": messages}

    return dataset.map(to_prompt)


def main(script_args: BigMathScriptArguments, training_args: QeRLGRPOConfig):
    train = make_bigmath_prompts(load_train_split(script_args), script_args.system_prompt, script_args.max_prompt_chars)
    return train_and_save(script_args, training_args, train)


def make_parser():
    return TrlParser((BigMathScriptArguments, QeRLGRPOConfig))


if __name__ == "__main__":
    script_args, training_args = make_parser().parse_args_and_config()
    main(script_args, training_args)
