"""Adaptive Quantization Noise (QeRL §3.3): scheduled channel-wise Gaussian noise folded into the norm weights
in front of q/k/v and gate/up, drawn afresh for every rollout round and pushed to the rollout engine.

- :class:`AQNSchedule`: σ per step (K equal stages, stage 0 noise-free, geometric decay σ_start -> σ_end).
- :func:`find_noise_targets`: which norm feeds which projections, found from the data flow.
- :class:`NormNoise`: seeded sampling; fp32 noised weights; apply in place / restore bit-exactly.
- :class:`AQNCallback`: the trainer-facing API (``begin_rollout`` / ``end_rollout`` / ``metrics``).
"""

from .callback import AQNCallback
from .noise import NormNoise, noise_seed, sample_noise
from .schedule import AQNSchedule
from .targets import AQNStructureError, NoiseTarget, find_noise_targets, vllm_param_name

__all__ = [
    "AQNCallback",
    "AQNSchedule",
    "AQNStructureError",
    "NoiseTarget",
    "NormNoise",
    "find_noise_targets",
    "noise_seed",
    "sample_noise",
    "vllm_param_name",
]
