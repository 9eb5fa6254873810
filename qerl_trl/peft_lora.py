"""PEFT LoRA on an NVFP4 base: one LoRA layer class for :class:`~qerl_trl.nvfp4.NVFP4Linear`, like PEFT's
bitsandbytes ``Linear4bit``, plus its registration with PEFT (done on ``import qerl_trl``).

After registration, ``get_peft_model(model, LoraConfig(target_modules="all-linear"))`` wraps every
``NVFP4Linear`` (``lm_head`` excluded, as PEFT excludes the output embedding) with :class:`NVFP4LoraLinear`;
explicit ``target_modules`` lists work too, and adapters save and load with PEFT's own API.

PEFT 0.21 has no public registry for extra LoRA layer types (``LoraConfig._register_custom_module`` is per
config object, so it is lost when ``PeftModel.from_pretrained`` rebuilds the config). So :func:`register`
wraps three PEFT internals, in this one place (written against PEFT 0.21.2):

* ``LoraModel._create_new_module``: our dispatcher runs first, as if it headed PEFT's ``dispatchers`` list
  (a user's own ``_register_custom_module`` mapping for ``NVFP4Linear`` still wins);
* ``peft.tuners.tuners_utils._maybe_include_all_linear_layers``: "all-linear" also selects ``NVFP4Linear``;
* ``peft.tuners.tuners_utils.cast_adapter_dtype``: PEFT upcasts bf16 adapters to fp32 by default
  (``autocast_adapter_dtype=True``); adapters on a bf16 NVFP4 base are put back to BF16, QeRL's setting.
  fp16 bases keep PEFT's fp32 upcast (fp16 training needs fp32 master weights).

Nothing changes for modules that are not ``NVFP4Linear``.

Merging is refused: ``merge``/``merge_and_unload``/``merge_adapter`` raise :class:`NVFP4MergeError`.
Requantizing ``Ŵ + s·BA`` to FP4 would throw away most of the update (a trained LoRA delta is mostly far below
one FP4 step of its block), silently, and unmerging could not restore the base. Serve the adapter next to
the NVFP4 base instead (vLLM LoRA, as QeRL's rollouts do), or merge into the original 16-bit checkpoint.
``unload()`` (drop adapters, no merge), ``disable_adapter()`` and ``unmerge`` (nothing is ever merged) work.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from .nvfp4 import NVFP4Linear

PEFT_VERSION_WRITTEN_AGAINST = "0.21.2"
#: init_lora_weights values that need no access to a dense base weight
_SUPPORTED_INITS = (True, False, "gaussian")


class NVFP4MergeError(RuntimeError):
    """Merging a LoRA adapter into an FP4 base is refused (see the module docstring)."""


def _merge_error(what: str) -> NVFP4MergeError:
    return NVFP4MergeError(
        f"cannot {what} a LoRA adapter into an NVFP4 base layer: requantizing W + BA to FP4 would discard most of "
        "the adapter's update (LoRA deltas are mostly below one FP4 step) and could not be undone. Keep the "
        "adapter separate (save it with `model.save_pretrained(dir)` and serve it with vLLM LoRA on the NVFP4 "
        "checkpoint), or merge it into the original 16-bit checkpoint: load that model in bf16, then "
        "`PeftModel.from_pretrained(bf16_model, adapter_dir).merge_and_unload()`. `model.unload()` removes "
        "the adapters without merging."
    )


#: LoRA variants PEFT 0.21 builds on a layer (config attribute, whether it is switched on)
_VARIANTS = (
    ("use_dora", lambda c: bool(getattr(c, "use_dora", False))),
    ("alora_invocation_tokens", lambda c: getattr(c, "alora_invocation_tokens", None) is not None),
    ("arrow_config", lambda c: getattr(c, "arrow_config", None) is not None),
    ("velora_config", lambda c: getattr(c, "velora_config", None) is not None),
    ("use_bdlora", lambda c: bool(getattr(c, "use_bdlora", False))),
    ("monteclora_config", lambda c: getattr(c, "monteclora_config", None) is not None),
    ("kasa_config", lambda c: getattr(c, "kasa_config", None) is not None),
)


def check_lora_config_for_nvfp4(config: Any) -> None:
    """Raise a ValueError naming every setting of a PEFT config that a LoRA on an NVFP4 base cannot have.

    Runs before any layer is built (the trainer calls it before quantizing a user's model), so a refused option
    costs nothing. Plain LoRA on Linear layers is what the frozen packed base supports.
    """
    if type(config).__name__ != "LoraConfig":
        raise ValueError(
            f"QeRL trains a LoRA on the NVFP4 base; got a {type(config).__name__}. Use peft.LoraConfig "
            "(or pass no peft_config for QeRLGRPOConfig's default LoRA)."
        )
    used = [name for name, on in _VARIANTS if on(config)]
    if used:
        raise ValueError(
            f"LoRA on NVFP4Linear supports plain LoRA only; {', '.join(used)} is not supported. "
            "Remove it from the LoraConfig."
        )
    init = config.init_lora_weights
    if not any(init is ok or (isinstance(init, str) and init == ok) for ok in _SUPPORTED_INITS):
        raise ValueError(
            f"init_lora_weights={init!r} needs a dense base weight, which an NVFP4 layer does not keep. "
            "Use True (default), False or 'gaussian'."
        )
    if getattr(config, "lora_bias", False):
        raise ValueError(
            "lora_bias=True needs merging into the base, which NVFP4 does not support: set lora_bias=False"
        )
    if getattr(config, "fan_in_fan_out", False):
        raise ValueError("fan_in_fan_out=True does not apply to NVFP4Linear (its weight is [out, in]): set it False")
    if getattr(config, "target_parameters", None):
        raise ValueError(
            f"target_parameters={list(config.target_parameters)} puts LoRA on raw parameters through PEFT's "
            "ParamWrapper, which adds B@A to the dense tensor; the packed NVFP4 base keeps none. Use target_modules."
        )


try:  # the class body needs PEFT; qerl_trl's core (format, NVFP4Linear) does not
    from peft.tuners.lora.layer import VARIANT_KWARG_KEYS, LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
except ImportError:  # pragma: no cover - peft is a hard dependency; keep the format usable without it
    LoraLayer = None


if LoraLayer is not None:

    class NVFP4LoraLinear(nn.Module, LoraLayer):
        """LoRA on a frozen :class:`NVFP4Linear`: ``y = base(x) + s * B(A(dropout(x)))``.

        The base runs through the NVFP4 matmul (no dense weight is kept for backward); only ``lora_A``/
        ``lora_B`` train. Adapters are created in the base's compute dtype (BF16 for a BF16 model) on its
        device. Plain LoRA only: DoRA and other variants, and initialisations that read a dense base weight
        (PiSSA, OLoRA, LoftQ, CorDA, orthogonal, LoRA-GA, MiCA), raise a ValueError. Merging raises
        :class:`NVFP4MergeError`.
        """

        def __init__(
            self,
            base_layer: nn.Module,
            adapter_name: str,
            config,
            r: int = 0,
            lora_alpha: int = 1,
            **kwargs: Any,
        ) -> None:
            super().__init__()
            LoraLayer.__init__(self, base_layer)
            self.fan_in_fan_out = False
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

        # -- PEFT hooks --------------------------------------------------------------------------------
        def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
            base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
            return base.in_features, base.out_features

        def _get_base_layer_device_and_dtype(self, base_layer: nn.Module):
            return base_layer.weight_packed.device, base_layer.compute_dtype

        def resolve_lora_variant(self, *, config, **kwargs):
            return None  # plain LoRA: update_layer's check_lora_config_for_nvfp4 has refused every variant

        def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs: Any) -> None:
            check_lora_config_for_nvfp4(config)
            super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

        # -- merging (refused) ------------------------------------------------------------------------
        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            raise _merge_error("merge")

        def unmerge(self) -> None:
            if not self.merged:
                warnings.warn("Already unmerged. Nothing to do.")
                return
            raise _merge_error("unmerge")  # pragma: no cover - merge() never succeeds

        def get_delta_weight(self, adapter: str) -> torch.Tensor:
            """``s · B A`` as a dense ``[out, in]`` tensor (for inspection; never added to the FP4 base)."""
            a, b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
            return (b @ a) * self.scaling[adapter]

        # -- forward ----------------------------------------------------------------------------------
        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self._check_forward_args(x, *args, **kwargs)
            adapter_names = kwargs.pop("adapter_names", None)
            variant_kwargs = {k: kwargs.pop(k, None) for k in VARIANT_KWARG_KEYS}
            if self.disable_adapters or self.merged:
                return self.base_layer(x, *args, **kwargs)
            if adapter_names is not None:
                return self._mixed_batch_forward(x, *args, adapter_names=adapter_names, **variant_kwargs, **kwargs)
            result = self.base_layer(x, *args, **kwargs)
            result_dtype = result.dtype
            for active_adapter in self.active_adapters:
                if active_adapter not in self.lora_A.keys():
                    continue
                lora_A = self.lora_A[active_adapter]
                lora_B = self.lora_B[active_adapter]
                dropout = self.lora_dropout[active_adapter]
                scaling = self.scaling[active_adapter]
                if not torch.is_autocast_enabled(x.device.type):
                    x = self._cast_input_dtype(x, lora_A.weight.dtype)
                result = result + (lora_B(lora_A(dropout(x))) * scaling).to(result_dtype)
            return result

        def __repr__(self) -> str:
            return "lora." + super().__repr__()

    def dispatch_nvfp4(target: nn.Module, adapter_name: str, config, **kwargs: Any) -> nn.Module | None:
        """PEFT LoRA dispatcher: an :class:`NVFP4LoraLinear` for an ``NVFP4Linear`` target, else ``None``."""
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if isinstance(base, NVFP4Linear):
            return NVFP4LoraLinear(target, adapter_name, config=config, **kwargs)
        return None


_REGISTERED = False


def _nvfp4_names(model: nn.Module) -> set[str]:
    """Names of bare NVFP4Linear modules PEFT's "all-linear" should add (no lm_head, nothing inside adapters)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import PreTrainedModel

    names = {n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    exclude: set[str] = set()
    if isinstance(model, PreTrainedModel):
        out_emb = model.get_output_embeddings()
        if out_emb is not None:
            exclude |= {n for n, m in model.named_modules() if m is out_emb}
    for prefix, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            exclude |= {f"{prefix}.{s}" for s, _ in module.named_modules() if s}
    return names - exclude


def register() -> None:
    """Teach PEFT's LoRA about NVFP4Linear (idempotent; called on ``import qerl_trl``). See the module docstring."""
    global _REGISTERED
    if _REGISTERED or LoraLayer is None:
        return
    from peft.tuners import tuners_utils
    from peft.tuners.lora.model import LoraModel

    original_create = LoraModel._create_new_module

    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        custom = lora_config._custom_modules or {}
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if not any(isinstance(base, k) for k in custom):
            new = dispatch_nvfp4(target, adapter_name, config=lora_config, **kwargs)
            if new is not None:
                return new
        return original_create(lora_config, adapter_name, target, **kwargs)

    _create_new_module.__wrapped__ = original_create
    LoraModel._create_new_module = staticmethod(_create_new_module)

    original_all_linear = tuners_utils._maybe_include_all_linear_layers

    def _maybe_include_all_linear_layers(peft_config, model):
        target = getattr(peft_config, "target_modules", None)
        all_linear = isinstance(target, str) and target.lower() == tuners_utils.INCLUDE_LINEAR_LAYERS_SHORTHAND
        peft_config = original_all_linear(peft_config, model)
        if all_linear:
            peft_config.target_modules = set(peft_config.target_modules) | _nvfp4_names(model)
        return peft_config

    _maybe_include_all_linear_layers.__wrapped__ = original_all_linear
    tuners_utils._maybe_include_all_linear_layers = _maybe_include_all_linear_layers

    original_cast = tuners_utils.cast_adapter_dtype

    def cast_adapter_dtype(model, adapter_name, autocast_adapter_dtype=True):
        original_cast(model, adapter_name=adapter_name, autocast_adapter_dtype=autocast_adapter_dtype)
        for module in model.modules():
            if isinstance(module, NVFP4LoraLinear) and module.get_base_layer().compute_dtype == torch.bfloat16:
                for layer_dict in (module.lora_A, module.lora_B):
                    if adapter_name in layer_dict:
                        layer_dict[adapter_name].to(torch.bfloat16)

    cast_adapter_dtype.__wrapped__ = original_cast
    tuners_utils.cast_adapter_dtype = cast_adapter_dtype
    _REGISTERED = True


register()
