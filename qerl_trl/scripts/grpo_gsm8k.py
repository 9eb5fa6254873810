"""GRPO on GSM8K with QeRL: NVFP4 base + BF16 LoRA + Adaptive Quantization Noise (the paper's GSM8K setting).

Shipped in the package so that ``qerl-trl train`` runs it from a plain ``pip install``; ``examples/grpo_gsm8k.py``
is the same script's entry point in a source checkout.

The same script as TRL's GRPO example with two names changed (``QeRLGRPOConfig``, ``QeRLGRPOTrainer``).

One GPU (Qwen2.5-7B-Instruct, the paper's 7B recipe; vLLM colocate rollouts on the FP4 weights):

    accelerate launch --config_file examples/accelerate_configs/single_gpu.yaml \\
        examples/grpo_gsm8k.py --config examples/recipes/qwen2.5-7b_gsm8k.yaml

Several GPUs on one host (DDP; each rank runs its own colocated vLLM engine):

    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml --num_processes 4 \\
        examples/grpo_gsm8k.py --config examples/recipes/qwen2.5-7b_gsm8k.yaml

Any option of the recipe can be overridden on the command line (``--learning_rate 2e-5``). The dataset is
``openai/gsm8k`` by default; ``--dataset_name`` also takes a local ``.json``/``.jsonl``/``.parquet``/``.csv``
file or directory with GSM8K's columns ``question`` and ``answer`` (``"... #### 42"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ScriptArguments, TrlParser

from ..trainer import QeRLGRPOConfig
from .inputs import load_train_split
from .training import train_and_save

SYSTEM_PROMPT = (
    "Solve the math problem step by step. At the end, write the final answer as a number after '####', "
    "for example: #### 42"
)


@dataclass
class GSM8KScriptArguments(ScriptArguments):
    """Script arguments for QeRL GRPO on GSM8K (TRL's `ScriptArguments` plus the prompt and reward options).

    Args:
        model_name_or_path: a 16-bit checkpoint (quantized to NVFP4 on load) or an NVFP4A16 one.
        system_prompt: system message put before each question; empty string for none.
        reward_funcs: reward functions from `qerl_trl.rewards` (by name) or dotted import paths.
        max_train_samples: keep only the first N training examples (quick runs).
    """

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model id or path: a 16-bit checkpoint or an NVFP4A16 one."}
    )
    dataset_name: str | None = field(
        default="openai/gsm8k",
        metadata={"help": "Hub dataset id, or a local .json/.jsonl/.parquet/.csv file or directory."},
    )
    dataset_config: str | None = field(default="main", metadata={"help": "Dataset configuration name."})
    system_prompt: str = field(default=SYSTEM_PROMPT, metadata={"help": "System prompt ('' for none)."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["gsm8k_accuracy_reward", "format_reward"],
        metadata={"help": "Reward functions: names in qerl_trl.rewards or dotted import paths."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N examples."})


def make_gsm8k_prompts(dataset, system_prompt: str):
    missing = {"question", "answer"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"GSM8K data needs columns 'question' and 'answer'; missing {sorted(missing)}.")

    def to_prompt(example):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": example["question"]})
        return {"prompt": messages}

    return dataset.map(to_prompt)


def main(script_args: GSM8KScriptArguments, training_args: QeRLGRPOConfig):
    train = make_gsm8k_prompts(load_train_split(script_args), script_args.system_prompt)
    return train_and_save(script_args, training_args, train)


def make_parser():
    return TrlParser((GSM8KScriptArguments, QeRLGRPOConfig))


if __name__ == "__main__":
    script_args, training_args = make_parser().parse_args_and_config()
    main(script_args, training_args)
