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
from typing import Any, Iterable, Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["cast_norms_to_fp32", "fp32_norms_during_load", "push_norm_weights"]

def cast_norms_to_fp32(model: nn.Module, param_names: Iterable[str]) -> list[str]:
    """Make the named 1-D norm weights float32 Parameters in place (keeping device); return the names changed.

    The module's ``weight`` attribute is replaced by a float32 Parameter so that vLLM's RMSNorm multiplies in fp32.
    """
    changed = []
    for name in param_names:
        mod_name, _, attr = name.rpartition(".")
        try:
            module = model.get_submodule(mod_name)
        except AttributeError:
            raise ValueError(
                f"AQN norm {name!r} was not found in vLLM's model ({type(model).__name__}); the HF and vLLM module "
                "trees differ for this architecture."
            ) from None
        w = getattr(module, attr)
        if w.dtype != torch.float32:
            setattr(module, attr, nn.Parameter(w.data.to(torch.float32), requires_grad=False))
            changed.append(name)
    return changed


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

    def _apply(model: nn.Module) -> int:
        params = dict(model.named_parameters())
        n = 0
        for name, value in noised.items():
            p = params.get(name)
            if p is None:
                raise KeyError(f"vLLM's model has no parameter {name!r} for the AQN noise.")
            p.data.copy_(value.to(device=p.device, dtype=p.dtype))
            n += 1
        return n

    return sum(llm.apply_model(_apply))
