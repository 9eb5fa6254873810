"""AQN's norms inside the colocated vLLM engine: kept in float32 from the moment vLLM loads its weights (so a small
σ survives bf16), and the noised values copied in place each round.

The cast itself is the plugin's load hook (:func:`qerl_trl.vllm_plugin.fp32_norms.install_fp32_norm_hook`), the same
one a ``qerl-trl vllm-serve`` engine uses: the norms' names go into the engine's HF config through ``hf_overrides``,
and right after vLLM loads the weights, before it compiles the model and captures CUDA graphs, the hook casts them.
vLLM 0.24's ``ir.ops.rms_norm`` dispatch then skips the ``vllm_c`` CUDA kernel (it requires weight dtype ==
activation dtype) and uses the native implementation, ``(x_hat.to(fp32) * w_fp32).to(bf16)``: small AQN σ (5e-4,
below bf16's 2^-7 step near 1.0) survives into the rollouts.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ...vllm_plugin.fp32_norms import FP32_NORMS_KEY, cast_norms_to_fp32, copy_norms_in_place, install_fp32_norm_hook

__all__ = ["cast_norms_to_fp32", "engine_norm_overrides", "push_norm_weights"]


def engine_norm_overrides(param_names: Iterable[str], hf_overrides: dict[str, Any] | None = None) -> dict | None:
    """The colocated engine's ``hf_overrides``: the LoRA backend's (if any) plus AQN's float32 norms, with the load
    hook installed in this process, where the engine runs (``distributed_executor_backend="external_launcher"``).
    None when there is nothing to override."""
    overrides = dict(hf_overrides or {})
    names = sorted(param_names)
    if names:
        install_fp32_norm_hook()
        overrides[FP32_NORMS_KEY] = names
    return overrides or None


def push_norm_weights(llm: Any, noised: dict[str, torch.Tensor]) -> int:
    """Copy AQN-noised norm weights (keyed by vLLM parameter name) in place into vLLM's model; return count."""
    return sum(llm.apply_model(lambda model: copy_norms_in_place(model, noised)))
