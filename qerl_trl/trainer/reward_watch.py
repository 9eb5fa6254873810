"""A warning for GRPO steps that cannot learn: every reward NaN, or no reward variance inside any group.

Why: GRPO's advantage is a completion's reward minus its group's mean (over its group's std). When every reward is
NaN, TRL treats the completions as unscorable and gives them advantage 0; when every group's completions got the
same reward, every advantage is 0 too. Either way the loss is 0 and the step changes nothing, yet training goes on
without a word (a reward function that returns NaN trained 'fine' with loss 0). This says so, once, and then at
most every :data:`REPEAT_EVERY` steps; it never stops training. Plain torch, no TRL imports.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["REPEAT_EVERY", "DegenerateRewardWatch", "degenerate_reward_message"]

logger = logging.getLogger(__name__)

#: after the first warning, at most one per this many optimizer steps
REPEAT_EVERY = 50


def degenerate_reward_message(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                              names: list[str]) -> str | None:  # fmt: skip
    """Why GRPO learns nothing from this batch of rewards (``[completions, reward functions]``, every process's
    gathered, in group order), or None if it can learn."""
    n = rewards_per_func.shape[0]
    if n == 0:
        return None
    nan = torch.isnan(rewards_per_func)
    if nan.all():
        return (
            f"every reward is NaN ({n} completions; reward functions {names}). GRPO learns nothing from such a step: "
            "TRL scores the completions as unscorable, their advantages are 0 and so is the loss. Check that each "
            "reward function returns a float for every completion (None or NaN only where one cannot be scored)."
        )
    if num_generations < 2 or n % num_generations:
        return None
    unscorable = nan.all(dim=1)
    rewards = (rewards_per_func.float() * weights.float().to(rewards_per_func.device)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    groups = rewards.view(-1, num_generations)
    scored = ~torch.isnan(groups)
    top = torch.where(scored, groups, -torch.inf).amax(dim=1)
    bottom = torch.where(scored, groups, torch.inf).amin(dim=1)
    varied = (scored.sum(dim=1) >= 2) & (top - bottom > 1e-6 * (1 + torch.maximum(top.abs(), bottom.abs())))
    if not bool(varied.any()):
        mean = torch.nanmean(rewards).item()
        return (
            f"every group of {num_generations} completions got the same reward (no reward variance in any of the "
            f"{groups.shape[0]} groups; mean reward {mean:.4g}). GRPO learns nothing from such a step: every advantage "
            "is 0. Check the reward function (does it return a constant?), and the task's difficulty: some completions "
            "of a prompt must succeed and some fail. More num_generations or a higher temperature also helps."
        )
    return None


class DegenerateRewardWatch:
    """Warns on the first degenerate step, then at most every :data:`REPEAT_EVERY` optimizer steps."""

    def __init__(self, repeat_every: int = REPEAT_EVERY) -> None:
        self.repeat_every = repeat_every
        self.last_warned: int | None = None

    def check(self, step: int, rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
              names: list[str]) -> str | None:  # fmt: skip
        """The warning given for ``step`` (also logged), or None."""
        if self.last_warned is not None and step - self.last_warned < self.repeat_every:
            return None
        why = degenerate_reward_message(rewards_per_func, weights, num_generations, names)
        if why is None:
            return None
        self.last_warned = step
        message = f"QeRL: step {step}: {why} (Warned at most every {self.repeat_every} steps; training goes on.)"
        logger.warning(message)
        return message
