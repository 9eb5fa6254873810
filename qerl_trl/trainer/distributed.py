"""Data-parallel training with a frozen NVFP4 base: what DDP must not touch.

``DistributedDataParallel`` broadcasts every parameter and buffer from rank 0 when it wraps the model
(``sync_module_states``). The NVFP4 base is frozen and identical on every rank (each loads or quantizes the same
checkpoint the same way), so that broadcast only moves the whole packed base over the network, and the gloo backend
cannot send its float8 block scales at all (``RuntimeError: Invalid scalar type`` when ``accelerate`` wraps the
model on CPU). The LoRA, the only trainable part, is still synchronized by DDP as usual.

Written against torch 2.11-2.13: DDP reads ``module._ddp_params_and_buffers_to_ignore`` (the attribute its own
``_set_params_and_buffers_to_ignore_for_model`` sets) when it is constructed.
"""

from __future__ import annotations

from torch import nn

from ..nvfp4 import NVFP4Linear
from ..nvfp4.experts import NVFP4Experts

__all__ = ["exclude_nvfp4_base_from_ddp"]


def exclude_nvfp4_base_from_ddp(model: nn.Module) -> list[str]:
    """Add every frozen tensor of every ``NVFP4Linear`` and ``NVFP4Experts`` of ``model`` to DDP's ignore list;
    return the names added.

    Call it on the module that will be wrapped (the PEFT model), before ``accelerator.prepare``.
    """
    names = []
    for mod_name, module in model.named_modules():
        if isinstance(module, (NVFP4Linear, NVFP4Experts)):
            for t_name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if not getattr(t, "requires_grad", False):
                    names.append(f"{mod_name}.{t_name}" if mod_name else t_name)
    existing = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []) or [])
    model._ddp_params_and_buffers_to_ignore = sorted(set(existing) | set(names))
    return names
