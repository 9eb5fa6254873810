"""What both training scripts read: a dataset split (Hub or local file) and reward functions named on the command
line or in a recipe."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["load_split", "load_train_split", "resolve_rewards"]


def load_split(name: str, config: str | None, split: str):
    """A Hub dataset split, or a local data file/directory (its only split, whatever ``split`` says)."""
    from datasets import load_dataset

    if os.path.isfile(name):
        ext = name.rsplit(".", 1)[-1].lower()
        builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}.get(ext)
        if builder is None:
            raise ValueError(f"Unsupported local dataset file {name!r}: use .json, .jsonl, .parquet or .csv.")
        return load_dataset(builder, data_files=name, split="train")
    if os.path.isdir(name):
        return load_dataset(name, split=split if split else "train")
    return load_dataset(name, config, split=split)


def resolve_rewards(names: list[str]):
    """Reward functions by name: one of :mod:`qerl_trl.rewards` or a dotted import path."""
    import importlib

    from .. import rewards

    out = []
    for name in names:
        if hasattr(rewards, name):
            out.append(getattr(rewards, name))
        elif "." in name:
            module, attr = name.rsplit(".", 1)
            out.append(getattr(importlib.import_module(module), attr))
        else:
            raise ValueError(f"Unknown reward function {name!r}: use one of {rewards.__all__} or a dotted path.")
    return out


def load_train_split(script_args: Any):
    """The script's training split (``dataset_name``, ``dataset_config``, ``dataset_train_split``), cut to
    ``max_train_samples`` if set; refuses a missing model first, before any data is read."""
    if not script_args.model_name_or_path:
        raise ValueError("Pass --model_name_or_path (or set model_name_or_path in the recipe).")
    train = load_split(script_args.dataset_name, script_args.dataset_config, script_args.dataset_train_split)
    if script_args.max_train_samples:
        train = train.select(range(min(script_args.max_train_samples, len(train))))
    return train
