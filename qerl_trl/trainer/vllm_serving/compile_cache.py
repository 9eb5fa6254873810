"""The key that keeps vLLM's torch.compile cache from serving one engine the kernels compiled for another."""

from __future__ import annotations

import hashlib
import json
from typing import Iterable

__all__ = ["compile_cache_marker"]

def compile_cache_marker(fp32_norm_names: Iterable[str], hf_overrides: dict | None = None) -> dict[str, str]:
    """vLLM ``additional_config`` that gives engines with float32 norms their own torch.compile cache.

    vLLM 0.24 keys its compile cache (``vllm/compilation/backends.py``) on its configs, env and the traced source
    files, not on parameter dtypes. The plugin's load hook changes the norms' dtype after the configs are
    hashed, so without a marker an AQN engine loads the kernels another engine compiled for bf16 norms on the same
    checkpoint (or the reverse) and generates garbage. ``VllmConfig.additional_config`` is hashed into that key.
    Engines without fp32 norms get a marker too, so a cache an AQN engine filled before this marker existed is
    never read by them.

    The single-LoRA engine (lora_backend="qerl") sizes its LoRA buffers from ``hf_overrides``, which vLLM leaves
    out of that key too (``ModelConfig.compute_hash`` ignores ``hf_overrides``): its LoRA spec goes in as well, so a
    run with another rank or other target modules never loads kernels compiled for the old shapes.
    """
    names = sorted(fp32_norm_names)
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:16] if names else "none"
    marker = {"qerl_fp32_norms": digest}
    if hf_overrides:
        marker["qerl_overrides"] = hashlib.sha256(json.dumps(hf_overrides, sort_keys=True).encode()).hexdigest()[:16]
    return marker
