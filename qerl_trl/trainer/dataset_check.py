"""Refuse a training dataset too small for one step, before the model loads.

TRL 1.16's ``RepeatSampler`` yields only whole generation batches of ``generation_batch_size / num_generations``
distinct prompts. A dataset with fewer prompts yields none: ``trainer.train()`` then runs 0 steps and says nothing,
after the model and the vLLM engine have loaded.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

__all__ = ["check_train_dataset", "prompts_per_generation"]


def prompts_per_generation(args: Any) -> int:
    """Distinct prompts one generation round draws (``GRPOConfig`` has resolved ``generation_batch_size``: the
    completions of one optimizer step's micro-batches on every process, times ``steps_per_generation``)."""
    return args.generation_batch_size // args.num_generations


def check_train_dataset(train_dataset: Any, args: Any) -> None:
    """Raise when ``train_dataset`` (a sized dataset) holds fewer prompts than one generation round needs; iterable
    datasets, whose length is unknown, and ``None`` (TRL's own error) pass."""
    if train_dataset is None or not isinstance(train_dataset, Sized):
        return
    need, have = prompts_per_generation(args), len(train_dataset)
    if have < need:
        raise ValueError(
            f"train_dataset has {have} prompt{'s' if have != 1 else ''}, fewer than the {need} one training step "
            f"needs (generation_batch_size {args.generation_batch_size} completions / num_generations "
            f"{args.num_generations}): the trainer would run 0 steps. Add prompts, or lower "
            "per_device_train_batch_size, gradient_accumulation_steps or generation_batch_size."
        )
