"""Which mixture-of-experts decoders QeRL trains (Qwen3-MoE), and the refusal of the others before any weight loads.

The four links a MoE policy needs, as read from each version's code (not assumed):

1. vLLM 0.24.0 serves compressed-tensors NVFP4A16 experts on Hopper: ``CompressedTensorsMoEMethod.get_moe_method``
   (``vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe.py``)
   returns ``CompressedTensorsW4A4Nvfp4MoEMethod(use_a16=True)`` for NVFP4 weights without input quantization, and
   ``select_nvfp4_moe_backend`` (``fused_moe/oracle/nvfp4.py``) falls through the FlashInfer/CUTLASS FP4 backends
   to ``MARLIN`` (``MarlinExperts``, ``fused_moe/experts/marlin_moe.py``: CUDA capability >= 7.5, ``kNvfp4Static``
   weights). Its Humming MoE method cannot load NVFP4A16 experts (an ``IndexError``; the GPU suite at 517d8d7).
2. vLLM 0.24.0 serves a LoRA on those experts: ``MarlinExperts`` mixes in ``LoRAExpertsMixin`` so
   ``FusedMoEWithLoRA`` (``vllm/lora/layers/fused_moe.py``) accepts it; its ``Qwen3MoeForCausalLM`` has
   ``is_3d_moe_weight = False``, so it loads per-expert adapters (``experts.<e>.gate_proj/up_proj/down_proj``).
3. transformers 5.17 (and 5.23) stores Qwen3-MoE / Mixtral experts as fused 3-D parameters
   (``Qwen3MoeExperts.gate_up_proj`` [experts, 2*moe_intermediate, hidden] and ``down_proj`` [experts, hidden,
   moe_intermediate]), not as ``nn.Linear``. For Qwen3-MoE, ``NVFP4Config`` on a 16-bit checkpoint (each layer's
   stack packed as transformers merges it) and ``quantize_model`` pack them into
   :class:`~qerl_trl.nvfp4.experts.NVFP4Experts`, saved per expert as vLLM reads them, and ``load_nvfp4`` reads such
   an NVFP4A16 checkpoint back packed.
4. PEFT 0.21.2 reaches expert tensors only through ``LoraConfig(target_parameters=[...])`` (``ParamWrapper``), which
   adds ``B @ A`` to a dense expert tensor that a packed NVFP4 base does not keep: the LoRA over packed experts is
   ours (:class:`~qerl_trl.peft_lora.NVFP4ExpertsLora`, ``target_modules`` naming ``"experts"``), saved per expert.

Other layouts (Mixtral's vLLM checkpoints name experts ``w1``/``w2``/``w3``; shared experts) would need their own
checkpoint writer and LoRA mapping: refused, naming what is trained instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from torch import nn

T = TypeVar("T")

#: the router of a sparse block stays 16-bit; llm-compressor's MoE recipes ignore it by this pattern (vLLM matches it)
ROUTER_IGNORE = "re:.*mlp.gate$"
#: a MoE decoder layer's attention projections: where its LoRA goes (the MLP is the packed experts)
MOE_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")

#: config attributes that mark a mixture-of-experts decoder (Qwen2/3-MoE: num_experts; Mixtral: num_local_experts)
_EXPERT_COUNT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts")

#: MoE decoders whose checkpoint layout NVFP4 experts are written in: per-expert ``mlp.experts.<e>.gate_proj`` /
#: ``up_proj`` / ``down_proj`` and the router ``mlp.gate``, no shared expert (vLLM's Qwen3-MoE loader reads those)
EXPERT_LAYOUT_MODEL_TYPES = ("qwen3_moe",)
#: what QeRL trains among mixture-of-experts decoders, and what to do with another (the refusal's second half)
MOE_SUPPORTED = (
    "QeRL trains Qwen3-MoE policies (model_type 'qwen3_moe'): the routed experts packed in NVFP4 (NVFP4Experts, "
    "written per expert as vLLM's Qwen3-MoE loader reads them, served by vLLM's Marlin MoE), the router 16-bit, "
    "the LoRA on the attention (and on the experts by naming 'experts'). Other MoE layouts (Mixtral's w1/w2/w3 "
    "experts, shared experts, gpt-oss) are not built: use a Qwen3-MoE or a dense model (Llama, Qwen2, Qwen3, "
    "Mistral families)."
)


class MoENotSupportedError(NotImplementedError):
    """A mixture-of-experts model of a layout QeRL does not train (anything but Qwen3-MoE) was given."""


def moe_expert_count(config: Any) -> int:
    """Number of routed experts a (text) config declares, as a config object or a ``config.json`` dict; 0 for a
    dense model."""
    if isinstance(config, Mapping):
        text = config.get("text_config") or config
        get = text.get
    else:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        get = lambda attr: getattr(text, attr, None)  # noqa: E731
    for attr in _EXPERT_COUNT_ATTRS:
        n = get(attr)
        if isinstance(n, int) and n > 1:
            return n
    return 0


def refuse_moe_config(config: Any, name: str) -> None:
    """Raise :class:`MoENotSupportedError` for a MoE config of a layout other than
    :data:`EXPERT_LAYOUT_MODEL_TYPES` (before any model or weight is built)."""
    n = moe_expert_count(config)
    model_type = config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    if n and model_type not in EXPERT_LAYOUT_MODEL_TYPES:
        raise MoENotSupportedError(f"{name} is a mixture-of-experts model ({n} experts, {model_type}). "
                                   + MOE_SUPPORTED)


def refuse_moe_model(model: nn.Module) -> None:
    """Raise :class:`MoENotSupportedError` for a model holding 3-D expert parameters (run on the meta model)."""
    experts = [n for n, p in model.named_parameters() if p.ndim == 3]
    if experts:
        raise MoENotSupportedError(
            f"{type(model).__name__} holds expert tensors ({experts[0]}) the NVFP4 Linear plan cannot convert. "
            + MOE_SUPPORTED
        )


def fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of the model's routed-expert stacks as transformers 5.17+ builds them: a module holding 3-D
    ``gate_up_proj`` [experts, 2 * width, hidden] and ``down_proj`` [experts, hidden, width] parameters."""
    out = {}
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if {"gate_up_proj", "down_proj"} <= set(params) and all(p.ndim == 3 for p in params.values()):
            out[name] = module
    return out


def check_expert_layout(model: nn.Module, experts: dict[str, nn.Module]) -> None:
    """A model with expert stacks must be one whose checkpoint names :class:`~qerl_trl.nvfp4.experts.NVFP4Experts`
    writes (:data:`EXPERT_LAYOUT_MODEL_TYPES`: Mixtral's vLLM checkpoints name experts ``w1``/``w2``/``w3``), with each
    router its sibling ``gate``, which :data:`ROUTER_IGNORE` keeps 16-bit; anything else is refused, naming it."""
    if not experts:
        return
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in EXPERT_LAYOUT_MODEL_TYPES:
        raise MoENotSupportedError(
            f"{type(model).__name__} is a mixture-of-experts model ({model_type}): NVFP4 experts are packed and "
            f"written for vLLM in the checkpoint layout of {', '.join(EXPERT_LAYOUT_MODEL_TYPES)} only (per-expert "
            "gate_proj/up_proj/down_proj, router mlp.gate); this model's experts or router are laid out otherwise."
        )
    for name in experts:
        parent = name.rpartition(".")[0]
        if not name.endswith("mlp.experts") or not isinstance(getattr(model.get_submodule(parent), "gate", None),
                                                              nn.Module):  # fmt: skip
            raise MoENotSupportedError(
                f"{name}: NVFP4 experts are written for vLLM with their router as the sibling 'mlp.gate' (Qwen3-MoE's "
                "layout, ignored as re:.*mlp.gate$); this model's experts or router are laid out otherwise."
            )


def beside_experts(model: nn.Module, experts: dict[str, nn.Module], plan: Callable[[], T]) -> T:
    """``plan()`` (e.g. the Linear conversion plan) with the expert stacks set aside: the Linear plan refuses 3-D
    expert parameters, which :class:`~qerl_trl.nvfp4.experts.NVFP4Experts` packs on its own."""
    aside = []
    for name in experts:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent)
        aside.append((holder, child, holder._modules[child]))
        holder._modules[child] = nn.Module()
    try:
        return plan()
    finally:
        for holder, child, module in aside:
            holder._modules[child] = module
