"""The run both training scripts end with: ``QeRLGRPOTrainer`` on the prepared prompts, then the LoRA adapter saved
(and pushed to the Hub when ``push_to_hub`` is set)."""

from __future__ import annotations

from typing import Any

from .inputs import resolve_rewards

__all__ = ["train_and_save"]


def train_and_save(script_args: Any, training_args: Any, train_dataset: Any):
    """Train on ``train_dataset`` (a ``prompt`` column) with the script's rewards; return the trainer."""
    from ..trainer import QeRLGRPOTrainer

    trainer = QeRLGRPOTrainer(
        model=script_args.model_name_or_path,
        reward_funcs=resolve_rewards(script_args.reward_funcs),
        args=training_args,
        train_dataset=train_dataset,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"LoRA adapter saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return trainer
