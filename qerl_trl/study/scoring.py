"""Held-out scoring: greedy completions from the HF policy, scored by a TRL-signature reward function.

Held-out accuracy is measured on the HF model, not in vLLM, so every arm of a comparison (a BF16 LoRA, an NVFP4
LoRA, with or without AQN) is scored by the same code on its noise-free policy. The caller removes AQN noise
first (``trainer.aqn.restore()``); with ``aqn_apply_to="rollout"`` the HF model is clean between rollouts anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["greedy_accuracy"]


def greedy_accuracy(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    reward_func: Callable[..., list[float]] | None = None,
    max_new_tokens: int = 8,
    batch_size: int = 64,
) -> float:
    """Mean reward of greedy completions of ``dataset["prompt"]`` (exact accuracy for a 0/1 reward).

    ``reward_func`` gets the completions plus every other dataset column as keyword lists, as TRL passes them;
    it defaults to :func:`qerl_trl.rewards.number_reward` (first number equals ``answer``). Conversational prompts
    go through the tokenizer's chat template.
    """
    import torch

    from ..rewards import number_reward

    reward_func = reward_func or number_reward
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    device = next(p for p in model.parameters() if p.is_floating_point()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    scores: list[float] = []
    try:
        for i in range(0, len(dataset), batch_size):
            batch = dataset[i : i + batch_size]
            texts = [
                p if isinstance(p, str) else tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                for p in batch["prompt"]
            ]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            columns = {k: v for k, v in batch.items() if k not in ("prompt", "completion")}
            scores += [float(r) for r in reward_func(completions, **columns)]
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return sum(scores) / max(1, len(scores))
