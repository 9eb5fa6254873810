"""Which PEFT LoRAs vLLM can serve, and the ``max_lora_rank`` it is served at (vLLM 0.24's rules)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["VLLM_ALLOWED_LORA_RANKS", "check_lora_config_for_vllm", "vllm_max_lora_rank"]

# vLLM 0.24 `vllm.config.lora.MaxLoRARanks`
VLLM_ALLOWED_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)

def vllm_max_lora_rank(lora_rank: int, requested: int | None = None) -> int:
    """vLLM's ``max_lora_rank`` for a LoRA of rank ``lora_rank``.

    vLLM only accepts ``max_lora_rank`` in ``VLLM_ALLOWED_LORA_RANKS``; any adapter rank up to it is served (its
    GPU buffers are zero-padded to ``max_lora_rank``), so a rank such as 24 is served padded to 32 with a warning.
    """
    if lora_rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {lora_rank}.")
    if requested is not None:
        if requested not in VLLM_ALLOWED_LORA_RANKS:
            raise ValueError(
                f"vllm_max_lora_rank={requested} is not a rank vLLM accepts; use one of {VLLM_ALLOWED_LORA_RANKS}."
            )
        if requested < lora_rank:
            raise ValueError(
                f"vllm_max_lora_rank={requested} is smaller than the LoRA rank {lora_rank}; set it to at least "
                f"{lora_rank} or leave it unset."
            )
        return requested
    for allowed in VLLM_ALLOWED_LORA_RANKS:
        if allowed >= lora_rank:
            if allowed != lora_rank:
                logger.warning(
                    "LoRA rank %d is not a rank vLLM serves natively; vLLM will serve it padded to max_lora_rank=%d "
                    "(same outputs, buffers sized for rank %d).",
                    lora_rank,
                    allowed,
                    allowed,
                )
            return allowed
    raise ValueError(
        f"LoRA rank {lora_rank} is larger than the largest rank vLLM can serve ({VLLM_ALLOWED_LORA_RANKS[-1]}). "
        "Use a smaller rank, or use_vllm=False."
    )


def check_lora_config_for_vllm(cfg: Any) -> int:
    """Raise a clear error for PEFT settings vLLM cannot serve as an adapter; return the LoRA rank."""
    problems = []
    if type(cfg).__name__ != "LoraConfig" and not hasattr(cfg, "lora_alpha"):
        raise ValueError(f"use_vllm=True serves LoRA adapters only; got a {type(cfg).__name__}.")
    if getattr(cfg, "use_dora", False):
        problems.append("DoRA (use_dora=True) is not supported by vLLM: set use_dora=False")
    if getattr(cfg, "bias", "none") != "none":
        problems.append(f"LoRA bias={cfg.bias!r} is not supported by vLLM: set bias='none'")
    if getattr(cfg, "modules_to_save", None):
        problems.append(
            f"modules_to_save={list(cfg.modules_to_save)} cannot be served by vLLM (it keeps the base frozen): "
            "remove modules_to_save"
        )
    ranks = set((getattr(cfg, "rank_pattern", None) or {}).values())
    if ranks - {cfg.r}:
        problems.append("per-module ranks (rank_pattern) are not supported by vLLM: use one rank")
    alphas = set((getattr(cfg, "alpha_pattern", None) or {}).values())
    if alphas - {cfg.lora_alpha}:
        problems.append("per-module alphas (alpha_pattern) are not supported by vLLM: use one lora_alpha")
    if getattr(cfg, "target_parameters", None):
        problems.append("target_parameters LoRA is not supported by the vLLM adapter path")
    targets = cfg.target_modules
    if isinstance(targets, (list, set, tuple)):
        bad = sorted(t for t in targets if t in ("lm_head", "embed_tokens"))
        if bad:
            problems.append(f"LoRA on {bad} is not served on the FP4 base: target only Linear layers")
    if problems:
        raise ValueError("This LoRA config cannot be served by vLLM: " + "; ".join(problems) + ".")
    return int(cfg.r)
