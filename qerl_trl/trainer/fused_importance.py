"""One forward pass fewer a step: the importance-sampling ratio from each micro-batch's training forward.

Why: with ``vllm_importance_sampling_correction`` (QeRL keeps it on: the FP4 + AQN rollout policy is not the trained
one), TRL 1.16's ``_generate_and_score_completions`` runs a no-grad forward over the whole generation round only to
get the trainer's log-probs of the rollout tokens, ``old_per_token_logps``. On an on-policy round (one iteration,
and the round's micro-batches all in one optimizer step) nothing changes the policy between that forward and the
training forwards that follow, so those log-probs are the training forward's own ``per_token_logps.detach()``:
the ratio ``exp(log p_trainer - log p_vLLM)`` can be built there, and the extra forward (about a fifth of the
training pass) goes. QeRL's ``fused_importance_sampling`` option does that.

Plain tensor functions here; the trainer wires them into TRL (written against TRL 1.16.0: ``_compute_loss`` reads
``inputs["importance_sampling_ratio"]`` after ``_get_per_token_logps_and_entropies``, and
``_generate_and_score_completions`` skips the extra forward when ``vllm_importance_sampling_correction`` is False and
``gradient_accumulation_steps`` is a multiple of ``steps_per_generation * num_iterations``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "IS_MODES",
    "fused_importance_enabled",
    "fused_importance_problem",
    "importance_sampling_metrics",
    "importance_sampling_ratio",
]

#: TRL 1.16's ``vllm_importance_sampling_mode`` values
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def fused_importance_problem(args: Any) -> str | None:
    """Why ``fused_importance_sampling`` cannot run with these GRPOConfig settings (after ``GRPOConfig`` resolved
    ``steps_per_generation``); None when it can."""
    if not args.use_vllm or not args.vllm_importance_sampling_correction:
        return ("it fuses vLLM's importance-sampling correction, which runs only with use_vllm=True and "
                "vllm_importance_sampling_correction=True")  # fmt: skip
    generate_every = args.steps_per_generation * args.num_iterations
    if args.num_iterations != 1 or args.gradient_accumulation_steps % generate_every:
        return (f"the rounds are not on-policy (num_iterations={args.num_iterations}, steps_per_generation="
                f"{args.steps_per_generation}, gradient_accumulation_steps={args.gradient_accumulation_steps}): the "
                "policy changes between a round's generation and its training forwards, so TRL's separate forward "
                "is needed. Use num_iterations=1 and gradient_accumulation_steps a multiple of steps_per_generation")
    if getattr(args, "use_liger_kernel", False):
        return "TRL's Liger loss does not read the ratio from the training forward; set use_liger_kernel=False"
    if args.vllm_importance_sampling_mode not in IS_MODES:
        return f"vllm_importance_sampling_mode must be one of {IS_MODES}, got {args.vllm_importance_sampling_mode!r}"
    return None


def fused_importance_enabled(args: Any) -> bool:
    """Whether a run takes the fused pass: ``fused_importance_sampling=True`` (the config refused it where it cannot
    run), or None ("where the rounds allow it": on-policy rounds with vLLM's correction on, TRL's separate forward
    elsewhere, so a run that cannot take it still trains as TRL does)."""
    setting = getattr(args, "fused_importance_sampling", False)
    return bool(setting) or (setting is None and fused_importance_problem(args) is None)


def importance_sampling_ratio(
    trainer_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """vLLM's importance-sampling ratio as TRL 1.16 builds it (``GRPOTrainer._generate_and_score_completions``):
    ``exp(log p_trainer - log p_vLLM)`` per token (``token_*``, shape ``(B, T)``) or summed per sequence
    (``sequence_*``, ``(B, 1)``), NaN log-probs counting as no correction, then truncated to ``clip_max`` (and
    ``clip_min``) or masked to 0 outside ``[clip_min, clip_max]``."""
    if mode not in IS_MODES:
        raise ValueError(f"Unknown vLLM importance sampling mode {mode!r}; one of {IS_MODES}.")
    diff = torch.nan_to_num((trainer_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def importance_sampling_metrics(
    trainer_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, ratio: torch.Tensor, mode: str
) -> dict[str, torch.Tensor]:
    """The local values TRL 1.16 logs as ``sampling/*`` for one batch: the |log-prob difference|'s mean and max over
    the masked tokens vLLM scored, and the ratio's min, mean and max (per token, or per sequence in ``sequence_*``
    modes)."""
    mask = mask.bool()
    delta = torch.abs(trainer_logps - sampling_logps)
    delta = delta[mask & ~torch.isnan(delta)]
    flat = ratio.flatten() if mode.startswith("sequence") else ratio[mask]
    zero = torch.zeros((), device=trainer_logps.device)

    def reduce(t: torch.Tensor, fn) -> torch.Tensor:
        return fn(t) if t.numel() else zero

    return {
        "sampling/sampling_logp_difference/mean": reduce(delta, torch.mean),
        "sampling/sampling_logp_difference/max": reduce(delta, torch.max),
        "sampling/importance_sampling_ratio/min": reduce(flat, torch.min),
        "sampling/importance_sampling_ratio/mean": reduce(flat, torch.mean),
        "sampling/importance_sampling_ratio/max": reduce(flat, torch.max),
    }
