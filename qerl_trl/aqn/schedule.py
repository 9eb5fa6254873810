"""The AQN noise schedule (QeRL paper §3.3, Alg. 1): K equal stages by step, geometric decay of σ."""

from __future__ import annotations

import math
from dataclasses import dataclass


def schedule_problem(sigma_start: object, sigma_end: object, num_stages: object, prefix: str = "") -> str | None:
    """What makes these schedule arguments invalid, with the valid range, or None. ``prefix`` names the fields as
    the caller's user knows them (``QeRLGRPOConfig``'s ``aqn_``), so its check and this class's say the same."""
    for name, v, example in (("sigma_start", sigma_start, "1e-2"), ("sigma_end", sigma_end, "5e-4")):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            return f"{prefix}{name} must be a finite number > 0 (a noise σ, e.g. {example}), got {v!r}."
    if sigma_end > sigma_start:
        return (
            f"{prefix}sigma_end ({sigma_end}) must be <= {prefix}sigma_start ({sigma_start}): AQN decays the noise "
            "from the first noisy stage to the last. Swap them, or set them equal for constant noise."
        )
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 2:
        return (
            f"{prefix}num_stages must be an integer >= 2 (stage 0 adds no noise, stages 1.. add it; the paper uses "
            f"10), got {num_stages!r}."
        )
    return None


@dataclass(frozen=True)
class AQNSchedule:
    """σ per training step.

    Training (``max_steps`` optimizer steps) is split into ``num_stages`` (K) equal stages by step:
    stage ``k = floor(step * K / max_steps)`` (integer arithmetic, so boundaries are exact; steps at or past
    ``max_steps`` stay in the last stage). Stage 0 adds no noise (the model sees quantization noise only).
    Stage k ≥ 1 uses ``σ_k = σ_start · (σ_end/σ_start)^((k−1)/(K−2))`` for k = 1..K−1, so σ runs exactly from
    ``sigma_start`` (stage 1) to ``sigma_end`` (stage K−1).

    K = 2 has a single noisy stage and the exponent is 0/0; we define σ_1 = ``sigma_start`` (the noise
    level the paper starts each run with). Use ``sigma_end == sigma_start`` to state that explicitly.
    """

    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    num_stages: int = 10

    def __post_init__(self) -> None:
        why = schedule_problem(self.sigma_start, self.sigma_end, self.num_stages)
        if why:
            raise ValueError(f"AQNSchedule: {why}")

    def stage(self, step: int, max_steps: int) -> int:
        """The stage (0..K−1) that optimizer step ``step`` (0-based, e.g. ``TrainerState.global_step``) is in."""
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(
                f"AQNSchedule needs max_steps >= 1 to place step {step} in a stage, got {max_steps!r} "
                "(set max_steps or num_train_epochs so the trainer knows the run length)"
            )
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"AQNSchedule: step must be an int >= 0, got {step!r}")
        return min(self.num_stages - 1, (step * self.num_stages) // max_steps)

    def stage_sigma(self, stage: int) -> float:
        """σ of a given stage (0.0 for stage 0)."""
        K = self.num_stages
        if not 0 <= stage < K:
            raise ValueError(f"AQNSchedule: stage must be in 0..{K - 1}, got {stage}")
        if stage == 0:
            return 0.0
        if K == 2 or stage == 1:
            return float(self.sigma_start)
        if stage == K - 1:
            return float(self.sigma_end)
        return float(self.sigma_start * (self.sigma_end / self.sigma_start) ** ((stage - 1) / (K - 2)))

    def sigma(self, step: int, max_steps: int) -> float:
        """σ to use for noise drawn at optimizer step ``step`` of a ``max_steps``-step run."""
        return self.stage_sigma(self.stage(step, max_steps))

    def boundaries(self, max_steps: int) -> list[int]:
        """First step of each stage (for plots and logs)."""
        return [-(-k * max_steps // self.num_stages) for k in range(self.num_stages)]
