"""The policy's LoRA read out of the PEFT model, in the two forms the LoRA backends serve it: PEFT's saved-adapter
tensors (vLLM's adapter loader) and ``(A, B)`` per module with one scaling (QeRL's in-layer LoRA)."""

from __future__ import annotations

import torch
from torch import nn

from ...peft_lora import EXPERT_PROJECTIONS, NVFP4ExpertsLora
from ...vllm_plugin import OTHER_BACKEND_HINT  # the package imports no vLLM

__all__ = ["lora_target_leaves", "peft_lora_modules", "peft_to_vllm_lora_tensors"]

def peft_to_vllm_lora_tensors(model: nn.Module, adapter_name: str = "default",
                              copy: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """The adapter's tensors under the names vLLM's LoRA loader parses (PEFT's saved-adapter names).

    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` etc.: the names PEFT's
    ``get_peft_model_state_dict`` gives, so vLLM's ``parse_fine_tuned_lora_name`` maps them onto its (packed)
    qkv_proj / gate_up_proj LoRA slices. Read from the LoRA layers themselves, not through
    ``get_peft_model_state_dict``: that walks the whole model's ``state_dict()`` and, with its default
    ``save_embedding_layers="auto"``, re-reads the base model's config (or asks the Hub) on every call, work that
    grows with the model and is repeated every round of the ``"vllm"`` backend's sync. ``copy``: the caller's own
    copies (vLLM scales B in place), one copy a LoRA tensor, and one a projection's stack for a LoRA over experts
    (its per-expert tensors are views of it: 36,864 at Qwen3-30B-A3B, not as many copies).
    """
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        extra = [key for key in ("lora_embedding_A", "lora_magnitude_vector")
                 if adapter_name in (getattr(module, key, None) or {})]  # fmt: skip
        if (isinstance(lora_b, nn.ModuleDict) and adapter_name in lora_b
                and getattr(lora_b[adapter_name], "bias", None) is not None):  # fmt: skip
            extra.append("lora_B bias")
        if extra or (isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict)
                     and adapter_name in module.modules_to_save):  # fmt: skip
            raise ValueError(
                f"Adapter tensor of {name!r} ({', '.join(extra) or 'modules_to_save'}) is not a LoRA A/B weight; vLLM "
                "can serve only plain LoRA adapters (no DoRA magnitudes, biases, embeddings or modules_to_save)."
            )
        if not isinstance(lora_a, nn.ModuleDict) or adapter_name not in lora_a:
            continue
        if isinstance(module, NVFP4ExpertsLora):  # per expert, as vLLM's fused-MoE LoRA reads an adapter
            for stacked, proj in EXPERT_PROJECTIONS:
                a, b = getattr(lora_a[adapter_name], stacked).detach(), getattr(lora_b[adapter_name], stacked).detach()
                a, b = (a.clone(), b.clone()) if copy else (a, b)
                for e in range(a.shape[0]):
                    out[f"{name}.{e}.{proj}.lora_A.weight"], out[f"{name}.{e}.{proj}.lora_B.weight"] = a[e], b[e]
            continue
        a, b = lora_a[adapter_name].weight.detach(), lora_b[adapter_name].weight.detach()
        out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = (a.clone(), b.clone()) if copy else (a, b)
    if not out:
        raise ValueError(f"The model has no LoRA weights for adapter {adapter_name!r}.")
    return out


def peft_lora_modules(
    model: nn.Module, adapter_name: str = "default"
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """The policy's LoRA for the single-LoRA engine path (:mod:`qerl_trl.vllm_plugin`):
    ``({module name in vLLM's tree: (A [r, in], B [out, r])}, scaling)``.

    PEFT's ``base_model.model.`` prefix is dropped (``model.layers.0.self_attn.q_proj``: the decoder models vLLM and
    transformers share name their modules alike). The tensors are PEFT's own (no copy); the engine folds the one
    ``scaling`` (``lora_alpha / r``, or rsLoRA's) into B as it copies it. :func:`check_lora_config_for_vllm` has
    ruled out per-module alphas, so every module has the same scaling; a model where they differ is an error.
    """
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scalings = set()
    for name, module in model.named_modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if not isinstance(lora_a, nn.ModuleDict) or adapter_name not in lora_a:
            continue
        if isinstance(module, NVFP4ExpertsLora):
            raise ValueError(f"{name} carries a LoRA on the routed experts, which vllm_lora_backend='qerl' does not "
                             f"serve (it serves Linear layers). {OTHER_BACKEND_HINT}")  # fmt: skip
        out[name.removeprefix("base_model.model.")] = (lora_a[adapter_name].weight.detach(),
                                                       lora_b[adapter_name].weight.detach())  # fmt: skip
        scalings.add(float(module.scaling[adapter_name]))
    if not out:
        raise ValueError(f"The model has no LoRA modules for adapter {adapter_name!r}.")
    if len(scalings) != 1:
        raise ValueError(f"vllm_lora_backend='qerl' serves one LoRA scaling, the model has {sorted(scalings)}. "
                         f"{OTHER_BACKEND_HINT}")  # fmt: skip
    return out, scalings.pop()


def lora_target_leaves(model: nn.Module, adapter_name: str = "default") -> tuple[str, ...]:
    """The leaf names of the modules the LoRA targets (``q_proj``, ``down_proj``, ...), sorted: what QeRL's in-layer
    LoRA spec names, for a colocated engine, a server, and the trainer's check of a server."""
    return tuple(sorted({name.rsplit(".", 1)[-1] for name in peft_lora_modules(model, adapter_name)[0]}))
