"""AQN's norms inside vLLM's model, in float32 (plain torch; imports no vLLM at import time).

AQN's σ goes down to 5e-4, below bf16's step of 2^-7 near 1.0, so the noised norm weights must be float32 inside the
engine. The names travel in the engine's HF config (``hf_overrides``, key :data:`FP32_NORMS_KEY`), and
:func:`install_fp32_norm_hook` casts them right after the weights load, before vLLM compiles the model and captures
CUDA graphs, so the graphs read the float32 weights. One mechanism for both engines: the plugin's ``register()``
installs the hook in every vLLM process (an engine of ``qerl-trl vllm-serve``), and the trainer installs it in its
own process, where its colocated engine runs (:func:`qerl_trl.trainer.vllm_serving.engine_norm_overrides`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["FP32_NORMS_KEY", "cast_norms_to_fp32", "copy_norms_in_place", "install_fp32_norm_hook"]

#: the key of the engine's HF config (set through ``hf_overrides``) that lists the norm weights kept in float32
FP32_NORMS_KEY = "qerl_fp32_norms"


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


def copy_norms_in_place(model: nn.Module, noised: Mapping[str, torch.Tensor]) -> int:
    """Copy AQN-noised norm weights (keyed by vLLM parameter name) into ``model`` in place; return the count."""
    params = dict(model.named_parameters())
    for name, value in noised.items():
        p = params.get(name)
        if p is None:
            raise KeyError(f"vLLM's model has no parameter {name!r} for the AQN noise.")
        p.data.copy_(value.to(device=p.device, dtype=p.dtype))
    return len(noised)


_HOOKED = False


def install_fp32_norm_hook() -> None:
    """Wrap vLLM 0.24's ``BaseModelLoader.load_model`` (once per process): a model whose HF config lists
    :data:`FP32_NORMS_KEY` gets those norms cast to float32 as soon as its weights are loaded."""
    global _HOOKED
    if _HOOKED:
        return
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.BaseModelLoader.load_model

    def load_model(self, vllm_config, model_config, *args, **kwargs):
        model = original(self, vllm_config, model_config, *args, **kwargs)
        names = getattr(model_config.hf_config, FP32_NORMS_KEY, None)
        if names:
            changed = cast_norms_to_fp32(model, names)
            logger.info("qerl-trl: %d of %d AQN norm weights cast to float32", len(changed), len(names))
        return model

    base_loader.BaseModelLoader.load_model = load_model
    _HOOKED = True
