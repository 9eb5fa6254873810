"""Stop a run whose vLLM engine is not serving the policy being trained.

TRL's importance-sampling correction already computes both log-probs of every rollout token: vLLM's (the policy
that sampled it) and the trainer's (the policy being optimized). A healthy QeRL engine stays close: measured on
SmolLM2-135M, about 0.05 nats/token without AQN and 0.2-0.35 with AQN at σ = 1e-2. An engine that runs the wrong
kernels, weights or adapter is far off: 9.3 nats/token, or log-probs that are NaN. Such a run still logs losses
and steps, learns nothing (the learning study's AQN arm before ``compile_cache_marker``), and burns its GPU time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RolloutPolicyError", "RolloutPolicyGuard", "RoundGap"]


@dataclass
class RoundGap:
    """The guard's measure of one generation round, as sums that add up over its micro-batches (with
    ``fused_importance_sampling`` the trainer's log-probs of a round exist one micro-batch at a time). The sums stay
    on the device until :meth:`result`: adding a micro-batch costs the training pass no host sync."""

    step: int = 0
    sums: torch.Tensor | None = None  #: [|gap| over finite masked tokens, finite tokens, NaN tokens, masked tokens]

    def add(self, sampling_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor) -> RoundGap:
        mask = mask.bool()
        nan = torch.isnan(sampling_logps) & mask
        finite = mask & ~nan
        delta = torch.where(finite, (sampling_logps.float() - trainer_logps.float()).abs(), 0.0)
        sums = torch.stack([delta.sum(), finite.sum(), nan.sum(), mask.sum()]).double()
        self.sums = sums if self.sums is None else self.sums + sums
        return self

    def result(self) -> tuple[float, float]:
        """``(mean |gap| over the finite masked tokens, fraction of masked tokens whose vLLM log-prob is NaN)``."""
        if self.sums is None:
            return 0.0, 0.0
        gap_sum, finite, nan, tokens = self.sums.tolist()
        if not tokens:
            return 0.0, 0.0
        return (gap_sum / finite if finite else 0.0), nan / tokens


class RolloutPolicyError(RuntimeError):
    """vLLM's rollouts did not come from the policy being trained, for several rounds in a row."""


class RolloutPolicyGuard:
    """Counts generation rounds whose vLLM-vs-trainer log-prob gap is over ``max_gap``; raises after ``patience``.

    A round is bad when the mean ``|log p_vLLM - log p_trainer|`` over its completion tokens exceeds ``max_gap``
    nats, or when more than half of vLLM's log-probs are NaN (TRL drops NaN tokens from its own gap metric, so
    an engine that returns only NaN reads as a gap of 0 there).
    """

    def __init__(self, max_gap: float, patience: int = 3):
        if max_gap <= 0:
            raise ValueError(f"vllm_max_logprob_gap must be > 0 (or None to disable), got {max_gap}")
        self.max_gap = max_gap
        self.patience = patience
        self.bad_rounds: list[tuple[int, float, float]] = []  # (step, gap, NaN fraction) of consecutive bad rounds
        self.last: tuple[float, float] | None = None  # (gap, NaN fraction) of the latest round

    @staticmethod
    def measure(sampling_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
        """``(mean |gap| over finite masked tokens, fraction of masked tokens whose vLLM log-prob is NaN)``."""
        return RoundGap().add(sampling_logps, trainer_logps, mask).result()

    def is_bad(self, gap: float, nan_fraction: float) -> bool:
        return gap > self.max_gap or nan_fraction > 0.5

    def update(self, step: int, gap: float, nan_fraction: float, bad: bool | None = None) -> None:
        """Record one round (``bad`` overrides the local verdict, e.g. with any rank's); raise after ``patience``."""
        self.last = (gap, nan_fraction)
        bad = self.is_bad(gap, nan_fraction) if bad is None else bad
        if not bad:
            self.bad_rounds.clear()
            return
        self.bad_rounds.append((step, gap, nan_fraction))
        if len(self.bad_rounds) < self.patience:
            return
        steps = f"{self.bad_rounds[0][0]}..{self.bad_rounds[-1][0]}"
        gaps = ", ".join(f"{g:.2f}" for _, g, _ in self.bad_rounds)
        nans = ", ".join(f"{f:.0%}" for _, _, f in self.bad_rounds)
        raise RolloutPolicyError(
            f"vLLM's rollouts are not coming from the policy being trained: at steps {steps} the mean |log p_vLLM - "
            f"log p_trainer| per completion token was [{gaps}] nats (limit vllm_max_logprob_gap={self.max_gap:g}) "
            f"and [{nans}] of vLLM's log-probs were NaN. Training stopped so the run does not learn from these "
            "rollouts; checkpoints already saved are intact. Likely causes: a stale vLLM torch.compile cache (delete "
            "~/.cache/vllm/torch_compile_cache and restart), a checkpoint vLLM loads differently from transformers, "
            "or an adapter that did not reach the engine. If a gap this large is expected (very strong AQN noise), "
            "raise vllm_max_logprob_gap or set it to None."
        )
