"""AQN's norms inside vLLM: kept in float32 from the moment vLLM loads its weights (so a small σ survives bf16), and
the noised values copied in place each round.

``fp32_norms_during_load`` converts the AQN target norms of vLLM's model to float32 right after vLLM loads the
weights (wrapping ``BaseModelLoader.load_model``, vLLM 0.24), before vLLM compiles the model and captures CUDA
graphs. vLLM 0.24's ``ir.ops.rms_norm`` dispatch then skips the ``vllm_c`` CUDA kernel (it requires weight dtype ==
activation dtype) and uses the native implementation, ``(x_hat.to(fp32) * w_fp32).to(bf16)``: small AQN σ (5e-4,
below bf16's 2^-7 step near 1.0) survives into the rollouts.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from ...vllm_plugin.fp32_norms import cast_norms_to_fp32, copy_norms_in_place

logger = logging.getLogger(__name__)

__all__ = ["cast_norms_to_fp32", "fp32_norms_during_load", "push_norm_weights"]


@contextlib.contextmanager
def fp32_norms_during_load(param_names: list[str]) -> Iterator[None]:
    """While building a vLLM ``LLM``: right after vLLM loads its weights, cast ``param_names`` to float32.

    Wraps ``vllm.model_executor.model_loader.base_loader.BaseModelLoader.load_model`` (vLLM 0.24), which runs
    inside the worker's "weights" memory pool (so sleep level 1 offloads/restores them too) and before
    torch.compile tracing and CUDA-graph capture.
    """
    if not param_names:
        yield
        return
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.BaseModelLoader.load_model

    def load_model(self, *args, **kwargs):
        model = original(self, *args, **kwargs)
        changed = cast_norms_to_fp32(model, param_names)
        logger.info("AQN: %d vLLM norm weights kept in float32", len(changed))
        return model

    base_loader.BaseModelLoader.load_model = load_model
    try:
        yield
    finally:
        base_loader.BaseModelLoader.load_model = original


def push_norm_weights(llm: Any, noised: dict[str, torch.Tensor]) -> int:
    """Copy AQN-noised norm weights (keyed by vLLM parameter name) in place into vLLM's model; return count."""
    return sum(llm.apply_model(lambda model: copy_norms_in_place(model, noised)))
