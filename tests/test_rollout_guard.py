"""The rollout-policy guard: a run whose vLLM engine is not serving the trained policy stops with a clear error."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from qerl_trl.trainer.rollout_guard import RolloutPolicyError, RolloutPolicyGuard, RoundGap


def test_measure_uses_masked_finite_tokens_and_counts_nan():
    sampling = torch.tensor([[-1.0, -2.0, float("nan"), -9.0], [-0.5, float("nan"), float("nan"), 0.0]])
    trainer = torch.tensor([[-1.5, -1.0, -1.0, -1.0], [-0.5, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    gap, nan = RolloutPolicyGuard.measure(sampling, trainer, mask)
    assert gap == pytest.approx((0.5 + 1.0 + 0.0) / 3) and nan == pytest.approx(3 / 6)
    assert RolloutPolicyGuard.measure(sampling, trainer, torch.zeros_like(mask)) == (0.0, 0.0)


def test_a_round_summed_over_micro_batches_is_the_whole_rounds_measure():
    """The fused ratio's guard adds a round's micro-batches one by one, keeping the sums on the device."""
    gen = torch.Generator().manual_seed(0)
    sampling, trainer = -torch.rand(6, 5, generator=gen) * 3, -torch.rand(6, 5, generator=gen) * 3
    sampling[1, 2] = sampling[4, 0] = float("nan")
    mask = (torch.rand(6, 5, generator=gen) > 0.3).long()
    gap = RoundGap(step=3)
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        gap.add(sampling[rows], trainer[rows], mask[rows])
        assert isinstance(gap.sums, torch.Tensor)
    assert gap.result() == pytest.approx(RolloutPolicyGuard.measure(sampling, trainer, mask))
    assert RoundGap().result() == (0.0, 0.0)


def test_raises_after_three_bad_rounds_in_a_row_and_resets_on_a_good_one():
    guard = RolloutPolicyGuard(max_gap=2.0)
    guard.update(1, 9.3, 0.0)
    guard.update(2, 9.1, 0.0)
    guard.update(3, 0.3, 0.0)  # an AQN-sized gap is healthy: the count starts over
    guard.update(4, 0.0, 1.0)  # TRL reports a gap of 0 when every vLLM log-prob is NaN
    guard.update(5, 9.0, 0.0)
    with pytest.raises(RolloutPolicyError, match=r"steps 4\.\.6.*vllm_max_logprob_gap=2.*torch_compile_cache"):
        guard.update(6, 8.0, 0.2)


def test_bad_limit_is_a_clear_error():
    with pytest.raises(ValueError, match="vllm_max_logprob_gap"):
        RolloutPolicyGuard(0.0)
    from qerl_trl import QeRLGRPOConfig

    with pytest.raises(ValueError, match="vllm_max_logprob_gap"):
        QeRLGRPOConfig(output_dir="/tmp/x", vllm_max_logprob_gap=-1.0, use_cpu=True)
    assert QeRLGRPOConfig(output_dir="/tmp/x", vllm_max_logprob_gap=None, use_cpu=True).vllm_max_logprob_gap is None


def test_trainer_check_stops_every_rank_when_any_rank_is_bad():
    from qerl_trl.trainer.grpo_trainer import QeRLGRPOTrainer

    class Accelerator:
        device = torch.device("cpu")

        def gather(self, t):  # another rank reports a bad round
            return torch.cat([t, torch.ones_like(t)])

    fake = SimpleNamespace(
        _rollout_guard=RolloutPolicyGuard(2.0), accelerator=Accelerator(), state=SimpleNamespace(global_step=0)
    )
    fake._judge_round = lambda *a: QeRLGRPOTrainer._judge_round(fake, *a)
    healthy = {"sampling_per_token_logps": torch.full((2, 3), -1.0), "old_per_token_logps": torch.full((2, 3), -1.05),
               "completion_mask": torch.ones(2, 3)}  # fmt: skip
    for step in range(2):
        fake.state.global_step = step
        QeRLGRPOTrainer._check_rollout_policy(fake, healthy)
    fake.state.global_step = 2
    with pytest.raises(RolloutPolicyError):
        QeRLGRPOTrainer._check_rollout_policy(fake, healthy)
    assert math.isclose(fake._rollout_guard.bad_rounds[-1][1], 0.05, abs_tol=1e-6)
    # without TRL's importance-sampling log-probs there is nothing to check
    QeRLGRPOTrainer._check_rollout_policy(fake, {"completion_mask": torch.ones(1, 1)})
