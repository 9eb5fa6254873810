"""``AQNCallback``: AQN per generation round, driven by the trainer.

``TrainerCallback`` has no generation event, so the GRPO trainer calls :meth:`AQNCallback.begin_rollout` right
before it generates and :meth:`AQNCallback.end_rollout` right after; the usual callback events keep checkpoints,
evaluation and the end of training noise-free.

When noise is present (``apply_to``):

- ``"rollout"`` (default, the paper's setting): only the rollout policy is noisy. ``begin_rollout`` returns the
  noised norm weights for the rollout engine (vLLM) and, if generation runs on the HF model
  (``hf_generation=True``), applies them there too; ``end_rollout`` restores the clean weights. Every training
  forward/backward (old/ref log-probs, loss) sees clean norms.
- ``"rollout_and_policy"``: ``begin_rollout`` also applies the round's noise to the HF model and ``end_rollout``
  keeps it, so the log-probs computed after generation and the loss forward/backward of every optimizer step
  trained on this round's completions use the same noised norms. ``on_step_end`` restores the clean weights
  (so ``_maybe_log_save_evaluate`` saves and evaluates a clean model) and ``on_step_begin`` re-applies the
  round's noise (identical: same seed and round step) for the next optimizer step, until the next
  ``begin_rollout`` draws a new round. Note that with ``beta > 0`` the reference log-probs (PEFT adapter
  disabled, same norms) are then noisy too.

Schedule position and noise both derive from ``state.global_step`` and ``state.max_steps`` at the rollout, and
noise is seeded from ``(seed, global_step)``: a run resumed from a checkpoint continues the schedule and draws
exactly the noise an uninterrupted run would, on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn
from transformers import TrainerCallback

from .noise import NormNoise
from .schedule import AQNSchedule
from .targets import NoiseTarget, vllm_param_name

__all__ = ["AQNCallback"]

APPLY_TO = ("rollout", "rollout_and_policy")


class AQNCallback(TrainerCallback):
    """Adaptive Quantization Noise for GRPO rollouts (see the module docstring for when noise is present)."""

    def __init__(
        self,
        schedule: AQNSchedule | None = None,
        seed: int = 0,
        apply_to: Literal["rollout", "rollout_and_policy"] = "rollout",
        targets: Sequence[NoiseTarget] | None = None,
    ) -> None:
        if apply_to not in APPLY_TO:
            raise ValueError(f"AQNCallback: apply_to must be one of {APPLY_TO}, got {apply_to!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"AQNCallback: seed must be an int, got {seed!r}")
        if schedule is not None and not isinstance(schedule, AQNSchedule):
            raise TypeError(f"AQNCallback: schedule must be an AQNSchedule, got {type(schedule).__name__}")
        self.schedule = schedule or AQNSchedule()
        self.seed = seed
        self.apply_to = apply_to
        #: the norms to noise, as found once by the trainer (which also keeps them float32 in vLLM); None: found on
        #: the model at first use
        self.targets = list(targets) if targets is not None else None
        self._noise: NormNoise | None = None
        self._round: tuple[float, int, int] | None = None  # (sigma, stage, step) of the last rollout

    # -- the trainer's explicit hooks --------------------------------------------------------------------------

    def noise_for(self, model: nn.Module) -> NormNoise:
        """The :class:`NormNoise` of ``model`` (targets discovered once, on first use)."""
        if self._noise is None or self._noise.model is not model:
            if self._noise is not None:
                self._noise.restore()
            self._noise = NormNoise(model, self.targets)
        return self._noise

    def _position(self, state) -> tuple[float, int, int]:
        step = int(state.global_step)
        max_steps = int(state.max_steps)
        return self.schedule.sigma(step, max_steps), self.schedule.stage(step, max_steps), step

    def begin_rollout(self, model: nn.Module, state, hf_generation: bool = False) -> dict[str, torch.Tensor]:
        """Draw this round's noise; return ``{vLLM parameter name: noised weight}`` (float32).

        The returned weights are ``w_clean + z`` for every target (the clean weights at stage 0), keyed by
        :func:`vllm_param_name`. The HF model is noised in place when generation runs on it
        (``hf_generation=True``) or when ``apply_to="rollout_and_policy"``; otherwise it stays clean.
        """
        noise = self.noise_for(model)
        noise.restore()
        sigma, stage, step = self._position(state)
        self._round = (sigma, stage, step)
        weights = noise.noised_weights(sigma, self.seed, step)
        if sigma > 0 and (hf_generation or self.apply_to == "rollout_and_policy"):
            noise.apply(sigma, self.seed, step)
        return {vllm_param_name(t): weights[t.name] for t in noise.targets}

    def end_rollout(self, model: nn.Module) -> None:
        """Restore the clean HF weights, unless ``apply_to="rollout_and_policy"`` keeps them for the loss."""
        if self._noise is not None and self.apply_to == "rollout":
            self._noise.restore()

    def clean_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``{vLLM parameter name: clean weight}`` (float32): push these to remove the noise (e.g. for eval)."""
        noise = self.noise_for(model)
        clean = noise.clean_weights()
        return {vllm_param_name(t): clean[t.name] for t in noise.targets}

    def restore(self) -> None:
        """Remove any noise from the HF model now."""
        if self._noise is not None:
            self._noise.restore()

    def metrics(self, state) -> dict[str, float]:
        """``{"aqn/sigma", "aqn/stage"}`` of the last rollout round (or of the current step before any)."""
        sigma, stage, _ = self._round if self._round is not None else self._position(state)
        return {"aqn/sigma": float(sigma), "aqn/stage": float(stage)}

    # -- TrainerCallback events --------------------------------------------------------------------------------

    def on_step_begin(self, args, state, control, **kwargs):
        if self.apply_to == "rollout_and_policy" and self._noise is not None and self._round is not None:
            sigma, _, step = self._round
            if sigma > 0 and not self._noise.is_applied:
                self._noise.apply(sigma, self.seed, step)

    def on_step_end(self, args, state, control, **kwargs):
        self.restore()

    def on_train_end(self, args, state, control, **kwargs):
        self.restore()

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Fallback when the trainer does not merge :meth:`metrics` itself (keys already present are kept)."""
        if logs is None or any(k.startswith("eval_") for k in logs):
            return
        if self._round is None and int(state.max_steps) < 1:
            return
        extra = {k: v for k, v in self.metrics(state).items() if k not in logs}
        logs.update(extra)
        if state.log_history and extra:
            for k, v in extra.items():
                state.log_history[-1].setdefault(k, v)
