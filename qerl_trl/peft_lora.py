"""PEFT LoRA on an NVFP4 base: one LoRA layer class per NVFP4 base type, like PEFT's bitsandbytes ``Linear4bit``
(:class:`NVFP4LoraLinear` for :class:`~qerl_trl.nvfp4.NVFP4Linear`, :class:`NVFP4ExpertsLora` for a MoE layer's
packed :class:`~qerl_trl.nvfp4.experts.NVFP4Experts`, targeted by the name ``"experts"``), plus their registration
with PEFT (done on ``import qerl_trl``).

After registration, ``get_peft_model(model, LoraConfig(target_modules="all-linear"))`` wraps every
``NVFP4Linear`` (``lm_head`` excluded, as PEFT excludes the output embedding) with :class:`NVFP4LoraLinear`;
explicit ``target_modules`` lists work too, and adapters save and load with PEFT's own API.

PEFT 0.21 has no public registry for extra LoRA layer types (``LoraConfig._register_custom_module`` is per
config object, so it is lost when ``PeftModel.from_pretrained`` rebuilds the config). So :func:`register`
wraps five PEFT internals, in this one place (written against PEFT 0.21.2):

* ``LoraModel._create_new_module``: our dispatcher runs first, as if it headed PEFT's ``dispatchers`` list
  (a user's own ``_register_custom_module`` mapping for ``NVFP4Linear`` still wins);
* ``peft.tuners.tuners_utils._maybe_include_all_linear_layers``: "all-linear" also selects ``NVFP4Linear``;
* ``peft.tuners.tuners_utils.cast_adapter_dtype``: PEFT upcasts bf16 adapters to fp32 by default
  (``autocast_adapter_dtype=True``); adapters on a bf16 NVFP4 base are put back to BF16, QeRL's setting.
  fp16 bases keep PEFT's fp32 upcast (fp16 training needs fp32 master weights);
* ``LoraModel._get_adapter_state_dict`` and ``LoraModel._remap_adapter_state_dict_for_load``: an expert LoRA's
  stacks save per expert, as vLLM's MoE LoRA reads an adapter, and load back from that file (which PEFT itself
  turns into its 3-D ``ParamWrapper`` layout on a transformers-5 MoE before this hook sees it).

Nothing changes for modules that are not ``NVFP4Linear`` or ``NVFP4Experts``.

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

    class _NVFP4LoraLayer(nn.Module, LoraLayer):
        """What every LoRA over a frozen packed NVFP4 base shares: PEFT's layer set-up, plain LoRA only (no
        variant), merging refused (:class:`NVFP4MergeError`)."""

        def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1,
                     **kwargs: Any) -> None:  # fmt: skip
            super().__init__()
            LoraLayer.__init__(self, base_layer)
            self.fan_in_fan_out = False
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

        def resolve_lora_variant(self, *, config, **kwargs):
            return None  # plain LoRA: update_layer's check_lora_config_for_nvfp4 has refused every variant

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            raise _merge_error("merge")

        def unmerge(self) -> None:
            if not self.merged:
                warnings.warn("Already unmerged. Nothing to do.")
                return
            raise _merge_error("unmerge")  # pragma: no cover - merge() never succeeds

        def __repr__(self) -> str:
            return "lora." + super().__repr__()

    class NVFP4LoraLinear(_NVFP4LoraLayer):
        """LoRA on a frozen :class:`NVFP4Linear`: ``y = base(x) + s * B(A(dropout(x)))``.

        The base runs through the NVFP4 matmul (no dense weight is kept for backward); only ``lora_A``/
        ``lora_B`` train. Adapters are created in the base's compute dtype (BF16 for a BF16 model) on its
        device. Plain LoRA only: DoRA and other variants, and initialisations that read a dense base weight
        (PiSSA, OLoRA, LoftQ, CorDA, orthogonal, LoRA-GA, MiCA), raise a ValueError. Merging raises
        :class:`NVFP4MergeError`.
        """

        # -- PEFT hooks --------------------------------------------------------------------------------
        def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
            base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
            return base.in_features, base.out_features

        def _get_base_layer_device_and_dtype(self, base_layer: nn.Module):
            return base_layer.weight_packed.device, base_layer.compute_dtype

        def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs: Any) -> None:
            check_lora_config_for_nvfp4(config)
            super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

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

    class _ExpertStacks(nn.Module):
        """One adapter's A (or B) matrices of every routed expert, stacked [experts, ...] per projection."""

        def __init__(self, shapes: dict[str, tuple[int, int, int]]) -> None:
            super().__init__()
            for name, shape in shapes.items():
                setattr(self, name, nn.Parameter(torch.zeros(shape)))

    #: the stacked parameters' names and the per-expert projections they save as (transformers / vLLM names)
    EXPERT_PROJECTIONS = (("experts_gate", "gate_proj"), ("experts_up", "up_proj"), ("experts_down", "down_proj"))

    class NVFP4ExpertsLora(_NVFP4LoraLayer):
        """LoRA on every routed expert of a frozen :class:`~qerl_trl.nvfp4.NVFP4Experts`: expert ``e``'s gate, up and
        down projections each get ``s * B_e A_e`` (``target_modules`` naming ``"experts"``, issue #54).

        Why a layer of ours: PEFT reaches transformers' fused expert tensors only through ``target_parameters``
        (``ParamWrapper``, which adds B@A to the dense 3-D parameter); the packed base keeps none. The adapters are
        held stacked ([experts, r, in] and [experts, out, r] per projection) and run as grouped GEMMs beside the
        base's (a per-expert loop where torch has none), in the base pass's sorted-by-expert order. They save and
        load per expert, as vLLM's MoE LoRA reads an adapter (``...mlp.experts.<e>.gate_proj.lora_A.weight``
        [r, hidden], ``lora_B`` [width, r]; ``up_proj`` alike; ``down_proj`` [r, width] and [hidden, r]). One
        adapter, plain LoRA, no dropout; merging is refused as on every NVFP4 layer.
        """

        def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
            base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
            return base.hidden, base.hidden

        def _get_base_layer_device_and_dtype(self, base_layer: nn.Module):
            return base_layer.gate_up_packed.device, None  # the packed stacks are integers: no dtype to follow

        def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs: Any) -> None:
            check_lora_config_for_nvfp4(config)
            if self.lora_A:
                raise ValueError(f"A LoRA over NVFP4 experts holds one adapter; it has {list(self.lora_A)} and was "
                                 f"asked for {adapter_name!r}.")  # fmt: skip
            if r <= 0 or r % 8:
                raise ValueError(f"A LoRA over NVFP4 experts needs a rank that is a multiple of 8 (torch's grouped "
                                 f"GEMM takes 16-byte rows of bf16; vLLM serves ranks 8, 16, 32, 64, ...), got r={r}.")
            dropout = float(getattr(config, "lora_dropout", 0.0) or 0.0)
            if dropout:
                raise ValueError(f"lora_dropout={dropout} on the experts: a LoRA over NVFP4 experts runs without "
                                 "dropout (QeRL's default LoRA has none); set lora_dropout=0.")  # fmt: skip
            base = self.get_base_layer()
            n, hidden, width = base.num_experts, base.hidden, base.width
            ins = {"experts_gate": hidden, "experts_up": hidden, "experts_down": width}
            outs = {"experts_gate": width, "experts_up": width, "experts_down": hidden}
            a = _ExpertStacks({k: (n, r, ins[k]) for k in ins})
            b = _ExpertStacks({k: (n, outs[k], r) for k in outs})
            init = config.init_lora_weights
            with torch.no_grad():
                for name in ins:
                    for e in range(n):  # each expert's A as nn.Linear's (PEFT's default), or N(0, 1/r)
                        if init == "gaussian":
                            nn.init.normal_(getattr(a, name)[e], std=1 / r)
                        else:
                            nn.init.kaiming_uniform_(getattr(a, name)[e], a=5**0.5)
                    if init is False:  # PEFT's "not a no-op" start
                        nn.init.kaiming_uniform_(getattr(b, name), a=5**0.5)
            self.r[adapter_name] = r
            self.lora_alpha[adapter_name] = lora_alpha
            use_rslora = bool(getattr(config, "use_rslora", False))
            self.use_rslora[adapter_name] = use_rslora
            self.scaling[adapter_name] = lora_alpha / (r**0.5 if use_rslora else r)
            self.lora_dropout[adapter_name] = nn.Identity()
            self.lora_A[adapter_name] = a.to(base.gate_up_packed.device)
            self.lora_B[adapter_name] = b.to(base.gate_up_packed.device)
            self.use_dora[adapter_name] = False
            self.lora_bias[adapter_name] = False
            self.set_adapter(self.active_adapters)

        @staticmethod
        def _delta(routed, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            """``x @ A_e^T @ B_e^T`` for each row's expert ``e``: two grouped GEMMs (in the activations' bf16), or
            one pair an expert (in the adapters' dtype)."""
            from .nvfp4.experts import grouped_mm

            if routed.offsets is not None:
                a, b = a.to(x.dtype), b.to(x.dtype)
                return grouped_mm(grouped_mm(x, a.transpose(-2, -1), routed.offsets), b.transpose(-2, -1),
                                  routed.offsets)  # fmt: skip
            x = x.to(a.dtype)
            return torch.cat([(x[lo:hi] @ a[e].T) @ b[e].T for e, lo, hi in routed.slices])

        def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
            base = self.get_base_layer()
            active = [name for name in self.active_adapters if name in self.lora_A]
            if self.disable_adapters or self.merged or not active:
                return base(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
            a, b, s = self.lora_A[active[0]], self.lora_B[active[0]], self.scaling[active[0]]
            hidden_states = base.check_input(hidden_states)
            routed = base.route(hidden_states, top_k_index)
            if routed is None:
                return torch.zeros_like(hidden_states)
            dtype = hidden_states.dtype
            gate, up = base.project(routed, routed.rows, "gate_up").chunk(2, dim=-1)
            gate = gate + (self._delta(routed, routed.rows, a.experts_gate, b.experts_gate) * s).to(dtype)
            up = up + (self._delta(routed, routed.rows, a.experts_up, b.experts_up) * s).to(dtype)
            h = base.act_fn(gate) * up
            out = base.project(routed, h, "down")
            out = out + (self._delta(routed, h, a.experts_down, b.experts_down) * s).to(dtype)
            return base.combine(routed, out, top_k_weights, hidden_states)

    def _experts_lora_layers(model: nn.Module) -> list[tuple[str, int]]:
        """``[(module name, experts)]`` of every :class:`NVFP4ExpertsLora` in ``model``."""
        return [(name, m.get_base_layer().num_experts) for name, m in model.named_modules()
                if isinstance(m, NVFP4ExpertsLora)]  # fmt: skip

    def experts_lora_per_expert(model: nn.Module, state: dict, adapter: str) -> dict:
        """An adapter state dict (keys with the adapter name) with each expert LoRA's stacks split per expert, named
        as vLLM's MoE LoRA reads them (``<layer>.<e>.gate_proj.lora_A.<adapter>.weight``)."""
        state = dict(state)
        for name, _ in _experts_lora_layers(model):
            for side in ("lora_A", "lora_B"):
                for stacked, proj in EXPERT_PROJECTIONS:
                    tensor = state.pop(f"{name}.{side}.{adapter}.{stacked}", None)
                    if tensor is not None:
                        for e in range(tensor.shape[0]):
                            state[f"{name}.{e}.{proj}.{side}.{adapter}.weight"] = tensor[e].contiguous()
        return state

    def _from_peft_3d(state: dict, stem: str, n: int, r: int, hidden: int, width: int) -> None:
        """PEFT's layout of a per-expert adapter on a transformers-5 MoE (``peft.utils.transformers_weight_conversion``
        of PEFT 0.21, which ``PeftModel.from_pretrained`` applies to a saved per-expert adapter): gate/up as the
        inner ``ParamWrapper`` (``experts.base_layer``: A [experts * 2r, hidden] expert-major, B [2 * width,
        2r * experts] rank-major and block-diagonal), down as the outer one (``experts``: A [experts * r, width], B
        [hidden, r * experts]), turned into the stacked names in place."""
        keys = [f"{stem}.base_layer.lora_A.weight", f"{stem}.base_layer.lora_B.weight", f"{stem}.lora_A.weight",
                f"{stem}.lora_B.weight"]  # fmt: skip
        if not all(k in state for k in keys):
            return
        gu_a, gu_b, d_a, d_b = (state.pop(k) for k in keys)
        want = ((n * 2 * r, hidden), (2 * width, 2 * r * n), (n * r, width), (hidden, r * n))
        got = tuple(tuple(t.shape) for t in (gu_a, gu_b, d_a, d_b))
        if got != want:
            raise ValueError(f"The adapter's LoRA on {stem} has shapes {got} in PEFT's 3-D layout, where {n} experts "
                             f"at rank {r} give {want}: the adapter is missing experts or has another rank or shape.")
        gu_a = gu_a.reshape(n, 2 * r, hidden)
        gu_b = gu_b.reshape(gu_b.shape[0], 2 * r, n).permute(2, 0, 1)  # [experts, 2 * width, 2r]
        state[f"{stem}.lora_A.experts_gate"], state[f"{stem}.lora_A.experts_up"] = gu_a[:, :r], gu_a[:, r:]
        state[f"{stem}.lora_B.experts_gate"] = gu_b[:, :width, :r]
        state[f"{stem}.lora_B.experts_up"] = gu_b[:, width:, r:]
        state[f"{stem}.lora_A.experts_down"] = d_a.reshape(n, -1, d_a.shape[-1])
        state[f"{stem}.lora_B.experts_down"] = d_b.reshape(d_b.shape[0], -1, n).permute(2, 0, 1)

    def experts_lora_stacked(model: nn.Module, state: dict) -> dict:
        """A saved adapter state dict (no adapter name) with each expert LoRA's per-expert tensors (or PEFT's 3-D
        layout of them) stacked back into the layer's parameters' checkpoint names; every expert of a projection or
        none (a partial set is an error that names what is missing)."""
        state = dict(state)
        for name, n in _experts_lora_layers(model):
            bare = name.removeprefix("base_model.model.")
            layer = model.get_submodule(name)
            base, r = layer.get_base_layer(), next(iter(layer.r.values()))
            # the checkpoint's keys carry PeftModel's prefix; the model may be the PeftModel, its LoraModel or bare
            for stem in {name, bare, f"base_model.model.{bare}", f"base_model.{name}"}:
                _from_peft_3d(state, stem, n, r, base.hidden, base.width)
                for side in ("lora_A", "lora_B"):
                    for stacked, proj in EXPERT_PROJECTIONS:
                        keys = [f"{stem}.{e}.{proj}.{side}.weight" for e in range(n)]
                        have = [k in state for k in keys]
                        if not any(have):
                            continue
                        if not all(have):
                            missing = [e for e, h in enumerate(have) if not h]
                            raise ValueError(f"The adapter's LoRA on {stem} ({proj}, {side}) has {sum(have)} of the "
                                             f"layer's {n} experts (missing e.g. {missing[:5]}): a LoRA over "
                                             "experts needs every expert's tensors.")  # fmt: skip
                        state[f"{stem}.{side}.{stacked}"] = torch.stack([state.pop(k) for k in keys])
        return state

    def dispatch_nvfp4(target: nn.Module, adapter_name: str, config, **kwargs: Any) -> nn.Module | None:
        """PEFT LoRA dispatcher: an :class:`NVFP4LoraLinear` for an ``NVFP4Linear`` target, an
        :class:`NVFP4ExpertsLora` for ``NVFP4Experts``, else ``None``."""
        from .nvfp4.experts import NVFP4Experts

        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if isinstance(base, NVFP4Linear):
            return NVFP4LoraLinear(target, adapter_name, config=config, **kwargs)
        if isinstance(base, NVFP4Experts):
            return NVFP4ExpertsLora(target, adapter_name, config=config, **kwargs)
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
        try:  # an expert LoRA follows the model's dtype (its packed base has none)
            embeddings = model.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            embeddings = None
        bf16_model = getattr(getattr(embeddings, "weight", None), "dtype", None) == torch.bfloat16
        for module in model.modules():
            bf16 = (module.get_base_layer().compute_dtype == torch.bfloat16 if isinstance(module, NVFP4LoraLinear)
                    else bf16_model and isinstance(module, NVFP4ExpertsLora))  # fmt: skip
            if bf16:
                for layer_dict in (module.lora_A, module.lora_B):
                    if adapter_name in layer_dict:
                        layer_dict[adapter_name].to(torch.bfloat16)

    cast_adapter_dtype.__wrapped__ = original_cast
    tuners_utils.cast_adapter_dtype = cast_adapter_dtype

    # an expert LoRA saves per expert, as vLLM's MoE LoRA reads it, and loads back from that layout
    original_get = LoraModel._get_adapter_state_dict.__func__
    original_remap = LoraModel._remap_adapter_state_dict_for_load.__func__

    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        out = original_get(cls, model, config, adapter_name, state_dict, unwanted_adapter_names)
        return experts_lora_per_expert(model, out, adapter_name)

    def _remap_adapter_state_dict_for_load(cls, model, config, adapter_name, state_dict):
        return original_remap(cls, model, config, adapter_name, experts_lora_stacked(model, state_dict))

    LoraModel._get_adapter_state_dict = classmethod(_get_adapter_state_dict)
    LoraModel._remap_adapter_state_dict_for_load = classmethod(_remap_adapter_state_dict_for_load)
    _REGISTERED = True


register()
