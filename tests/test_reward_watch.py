"""GRPO steps that cannot learn get a warning that says why and what to check, once and then at most every N
steps, and training goes on (issue #40)."""

from __future__ import annotations

import logging
import math

import torch

from qerl_trl.trainer.reward_watch import DegenerateRewardWatch, degenerate_reward_message

W1 = torch.ones(1)


def rewards(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(-1, 1)


def test_all_nan_rewards():
    msg = degenerate_reward_message(rewards(*[math.nan] * 8), W1, 4, ["exact"])
    assert msg.startswith("every reward is NaN (8 completions; reward functions ['exact'])")
    assert "advantages are 0 and so is the loss" in msg and "returns a float for every completion" in msg


def test_no_variance_in_any_group():
    msg = degenerate_reward_message(rewards(1, 1, 1, 1, 0, 0, 0, 0), W1, 4, ["exact"])
    assert "every group of 4 completions got the same reward" in msg and "any of the 2 groups" in msg
    assert "mean reward 0.5" in msg and "every advantage is 0" in msg and "does it return a constant?" in msg
    # one scored completion per group (the rest unscorable) is no variance either
    assert degenerate_reward_message(rewards(1, math.nan, math.nan, math.nan), W1, 4, ["r"]) is not None


def test_a_step_that_can_learn_passes():
    assert degenerate_reward_message(rewards(1, 1, 1, 1, 0, 1, 0, 0), W1, 4, ["exact"]) is None
    assert degenerate_reward_message(rewards(1, math.nan, 0, 0), W1, 4, ["exact"]) is None  # NaN ignored
    two = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # two functions whose weighted sums differ
    assert degenerate_reward_message(two, torch.tensor([1.0, 2.0]), 2, ["a", "b"]) is None
    assert degenerate_reward_message(two, torch.tensor([1.0, 1.0]), 2, ["a", "b"]) is not None


def test_warns_once_then_at_most_every_n_steps(caplog):
    watch = DegenerateRewardWatch(repeat_every=10)
    bad = rewards(*[math.nan] * 4)
    with caplog.at_level(logging.WARNING, logger="qerl_trl.trainer.reward_watch"):
        said = [step for step in range(25) if watch.check(step, bad, W1, 4, ["r"])]
    assert said == [0, 10, 20]
    assert len(caplog.records) == 3 and "QeRL: step 0: every reward is NaN" in caplog.records[0].getMessage()
    assert "training goes on" in caplog.records[0].getMessage()
    assert watch.check(30, rewards(0, 1, 0, 1), W1, 4, ["r"]) is None  # healthy steps say nothing
