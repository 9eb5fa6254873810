"""The policy's one trip into the trainer: :func:`prepare_policy` takes the ``model=`` a user gave
``QeRLGRPOTrainer`` and returns the NVFP4 base, the LoRA to train on it and the tokenizer.

In order, and nothing loaded or converted before every check has passed:

1. the form (``model_forms``): a model id/path, a 16-bit or NVFP4 ``PreTrainedModel``, or a ``PeftModel``;
2. the checks: the source (``model_source``), vLLM's presence, the architecture (a mixture-of-experts one refused,
   ``quantizer.moe``), the LoRA (``peft_lora``, and vLLM's serving rules), the tensor-parallel layout;
3. the load (a path through ``NVFP4Config``) or the conversion in place (an instance); a ``PeftModel``'s adapter is
   kept aside and put back by :meth:`PreparedPolicy.trainer_model`.

:func:`vllm_checkpoint` then gives the NVFP4A16 checkpoint the colocated engine serves, written from this policy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PreTrainedModel

from ..model_source import check_model_source
from ..nvfp4 import NVFP4Linear
from ..quantizer.moe import EXPERT_LAYOUT_MODEL_TYPES, MOE_LORA_TARGETS, moe_expert_count, refuse_moe_config
from .config import QeRLGRPOConfig
from .model_forms import (
    SplitPeftModel,
    check_peft_model,
    has_nvfp4,
    quantize_instance,
    rewrap_peft_model,
    split_peft_model,
)
from .nvfp4_cache import checkpoint_key, ensure_cached_checkpoint, is_nvfp4a16_config

logger = logging.getLogger(__name__)

__all__ = ["PreparedPolicy", "SUPPORTED_ARCHITECTURES", "check_architecture", "load_device_map", "prepare_policy",
           "vllm_checkpoint"]  # fmt: skip

#: Dense decoder families the NVFP4 quantizer, AQN's structure search and vLLM's LoRA path are tested on.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


@dataclass
class PreparedPolicy:
    """What the trainer needs of the policy."""

    base: PreTrainedModel  #: the NVFP4 base, without a LoRA (AQN's targets and vLLM's checkpoint are read off it)
    lora_config: Any  #: the LoRA to train: the user's ``peft_config``, the PeftModel's own, or the default
    processing_class: Any
    source: str | None  #: the model id/path the user gave, if any
    source_is_nvfp4: bool  #: that path is an NVFP4A16 checkpoint (vLLM serves it as it is)
    split: SplitPeftModel | None = None  #: a PeftModel's adapter tensors, put back by :meth:`trainer_model`

    def trainer_model(self) -> tuple[nn.Module, Any]:
        """``(model, peft_config)`` for ``GRPOTrainer.__init__``: a PeftModel's LoRA back on the NVFP4 base with its
        trained tensors (``peft_config`` None), else the base and the LoRA config TRL applies."""
        if self.split is not None:
            return rewrap_peft_model(self.base, self.split), None
        return self.base, self.lora_config


def prepare_policy(model: str | nn.Module, args: QeRLGRPOConfig, peft_config: Any = None,
                   processing_class: Any = None, quantization_config: Any = None) -> PreparedPolicy:  # fmt: skip
    """Resolve, check, then load or convert the policy (see the module doc). Raises before any weight is converted
    on anything the NVFP4 base, the LoRA or vLLM cannot run."""
    from peft import PeftModel

    if quantization_config is not None:
        raise ValueError(
            "QeRLGRPOTrainer always loads the base through NVFP4Config; do not pass quantization_config. "
            "Set the NVFP4 options (e.g. nvfp4_modules_to_not_convert) on QeRLGRPOConfig."
        )
    if isinstance(model, str):
        check_model_source(model)
    if args.use_vllm:
        from .vllm_serving import require_humming_if_forced, require_vllm

        require_vllm()
        require_humming_if_forced(args.vllm_fp4_kernel)

    source = model if isinstance(model, str) else None
    split = None
    if isinstance(model, PeftModel):  # everything is checked before anything is converted
        if peft_config is not None:
            raise ValueError(
                "You passed a PeftModel and a peft_config; pass one of them (the PeftModel's own LoRA is used)."
            )
        base = model.get_base_model()
        check_architecture(base.config, type(base).__name__)
        check_vllm_layout(base.config, args)
        own_lora = check_peft_model(model)[1]
        check_lora_early(own_lora, args)
        check_moe_lora(base.config, own_lora, args)
        split = split_peft_model(model)
        model, peft_config = split.base, split.lora_config
    else:
        peft_config = peft_config if peft_config is not None else args.default_lora_config()
        check_lora_early(peft_config, args)

    source_is_nvfp4 = False
    if isinstance(model, str):
        from transformers.trainer_utils import set_seed

        set_seed(args.seed)
        model, source_is_nvfp4 = load_nvfp4_model(model, args, peft_config)
    else:
        base = _base_model(model)
        check_architecture(base.config, type(base).__name__)
        check_vllm_layout(base.config, args)
        check_moe_lora(base.config, peft_config, args)
        if not has_nvfp4(model):
            quantize_instance(model, args.nvfp4_modules_to_not_convert)
    if split is None:
        peft_config = attention_lora_for_moe(peft_config, model)

    if processing_class is None:
        from transformers import AutoProcessor

        processing_class = AutoProcessor.from_pretrained(
            source or model.config._name_or_path,
            revision=(args.model_init_kwargs or {}).get("revision"),
            truncation_side="left",
            padding_side="left",
            trust_remote_code=args.trust_remote_code,
        )
    return PreparedPolicy(model, peft_config, processing_class, source, source_is_nvfp4, split)




def attention_lora_for_moe(lora_config: Any, model: nn.Module) -> Any:
    """A MoE policy's ``target_modules="all-linear"`` as its attention projections (a copy of the config).

    PEFT 0.21 turns "all-linear" on a transformers-5 MoE into ``target_parameters`` on the fused expert stacks and
    the router (``peft.utils.transformers_weight_conversion._convert_peft_config_moe``), which the packed experts
    cannot carry; the attention is where QeRL puts a MoE's LoRA by default (issue #54). A dense model's config is
    returned as it is."""
    import copy

    if lora_config is None or lora_config.target_modules != "all-linear" or not moe_expert_count(model.config):
        return lora_config
    lora_config = copy.deepcopy(lora_config)
    lora_config.target_modules = list(MOE_LORA_TARGETS)
    logger.info("QeRL: a mixture-of-experts policy: the LoRA ('all-linear') goes on the attention, %s",
                MOE_LORA_TARGETS)  # fmt: skip
    return lora_config


# -- the checks ---------------------------------------------------------------------------------------------------


#: module names of one MoE decoder layer (and the model's ends) a LoRA target must not reach: a regex target is
#: matched against them as PEFT matches names (``re.fullmatch``)
_MOE_NON_ATTENTION_NAMES = (
    "model.layers.0.mlp.gate", "model.layers.0.mlp.gate_proj",
    "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj", "model.layers.0.mlp.shared_expert.gate_proj",
    "model.layers.0.mlp.shared_expert_gate", "model.embed_tokens", "lm_head",
)


def targets_experts(lora_config: Any) -> bool:
    """Whether a LoRA config puts a LoRA on a MoE's routed experts (``"experts"`` in ``target_modules``, or a regex
    reaching ``model.layers.<i>.mlp.experts``)."""
    import re

    targets = getattr(lora_config, "target_modules", None)
    if isinstance(targets, str):
        return targets != "all-linear" and re.fullmatch(targets, "model.layers.0.mlp.experts") is not None
    return "experts" in set(targets or ())


def check_moe_lora(config: Any, lora_config: Any, args: Any = None) -> None:
    """A MoE policy's LoRA goes on its attention projections (q/k/v/o_proj, or "all-linear", which means them
    there) and, asked for by name (``"experts"``), on its routed experts (``peft_lora.NVFP4ExpertsLora``). Refuse,
    before any weight loads, targets on the router or elsewhere (PEFT would skip such a name quietly: those are not
    Linears), ``target_parameters`` (PEFT's way to the dense expert tensors the packed base does not keep), and an
    expert LoRA in rollouts that cannot serve it: QeRL's in-layer method serves Linears only, and a server is not
    wired for it; vLLM's adapters in colocate mode serve it (``args``: the trainer's config)."""
    import re

    if lora_config is None or not moe_expert_count(config):
        return
    bad = []
    params = getattr(lora_config, "target_parameters", None)
    if params:
        bad.append(f"target_parameters={list(params)}")
    targets = lora_config.target_modules
    if isinstance(targets, str):
        hits = [n for n in _MOE_NON_ATTENTION_NAMES if re.fullmatch(targets, n)] if targets != "all-linear" else []
        if hits:
            bad.append(f"target_modules={targets!r} (matches {hits[0]})")
    else:
        extra = sorted(set(targets or ()) - set(MOE_LORA_TARGETS) - {"experts"})
        if extra:
            bad.append(f"target_modules {extra}")
    if bad:
        raise ValueError(
            f"On a mixture-of-experts policy the LoRA goes on the attention projections {list(MOE_LORA_TARGETS)} "
            f"and, by the name 'experts', on the routed experts (each expert's gate, up and down); got "
            f"{'; '.join(bad)}. Use target_modules='all-linear' (the attention there), a subset of those four, "
            "and 'experts' to add the experts."
        )
    if args is not None and args.use_vllm and targets_experts(lora_config):
        if args.vllm_mode != "colocate":
            raise ValueError(
                "A LoRA on the routed experts is served in colocate mode only for now (a `qerl-trl vllm-serve` server "
                "is not wired for it): set vllm_mode='colocate', or drop 'experts' from target_modules."
            )
        if args.vllm_lora_backend != "vllm":
            raise ValueError(
                "A LoRA on the routed experts is served by vLLM's own LoRA adapters (its fused-MoE LoRA), not by "
                "QeRL's in-layer method, which serves Linear layers: set vllm_lora_backend='vllm', or drop 'experts' "
                "from target_modules."
            )


def check_architecture(config: Any, model_class_name: str | None = None) -> str:
    """Return the architecture name, or raise a clear error naming an unsupported one (a MoE other than Qwen3-MoE:
    ``quantizer.moe``'s refusal)."""
    archs = list(getattr(config, "architectures", None) or [])
    arch = model_class_name or (archs[0] if archs else type(config).__name__)
    if getattr(config, "model_type", None) in EXPERT_LAYOUT_MODEL_TYPES:
        return arch
    refuse_moe_config(config, arch)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"QeRLGRPOTrainer does not support the architecture {arch!r}. Supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (dense decoder-only models)."
        )
    return arch


def check_lora_early(lora_config: Any, args: QeRLGRPOConfig) -> None:
    """Refuse LoRA settings the NVFP4 base (or vLLM's serving of it) cannot run, before any weight loads."""
    from ..peft_lora import check_lora_config_for_nvfp4

    check_lora_config_for_nvfp4(lora_config)
    targets = lora_config.target_modules
    if isinstance(targets, (list, set, tuple)) and "lm_head" in targets:  # GRPOTrainer refuses it after loading
        raise ValueError(
            "LoRA on lm_head is never trained by GRPO (TRL computes log-probs from lm_head.weight directly): "
            "remove 'lm_head' from target_modules."
        )
    if args.use_vllm:
        from .vllm_serving import check_lora_config_for_vllm

        check_lora_config_for_vllm(lora_config)


def check_vllm_layout(config: Any, args: QeRLGRPOConfig) -> None:
    """Colocate mode: refuse a ``vllm_tensor_parallel_size`` vLLM cannot shard this model over, or that does not
    divide the number of processes, before any weight loads (vLLM would refuse it only once the engine starts,
    after the trainer has loaded the model). Server mode: the server's own setting. Either mode: a MoE model cannot
    run whole on Humming (``check_humming_for_experts``). ``vllm_return_routed_experts`` needs routed experts."""
    if args.vllm_return_routed_experts and not moe_expert_count(config):
        raise ValueError("vllm_return_routed_experts=True records a mixture-of-experts policy's routing; this "
                         f"{getattr(config, 'model_type', 'dense')} model has no routed experts. Leave it off for it.")
    if args.use_vllm:
        from ..vllm_plugin.fp4_kernel import check_humming_for_experts

        check_humming_for_experts(args.vllm_fp4_kernel, per_layer=args.vllm_lora_backend == "qerl",
                                  model_config=config.to_dict())  # fmt: skip
    if args.use_vllm and args.vllm_mode == "colocate":
        from .vllm_serving.parallel_rules import check_tensor_parallel_layout

        check_tensor_parallel_layout(config, args.vllm_tensor_parallel_size, args.world_size)


# -- the load -----------------------------------------------------------------------------------------------------


def load_device_map(state: Any, requested: Any = None) -> Any:
    """Where the policy loads: straight onto this process's GPU, as QLoRA is loaded under DDP.

    TRL 1.16 loads with ``device_map="auto"`` on one GPU and ``None`` (the CPU, then the Trainer moves it) under
    DDP. On the CPU, a 16-bit checkpoint would be quantized to NVFP4 by the CPU, and the Trainer would move the model
    only after AQN's target trace. So: the process's own device under DDP
    (one whole copy per rank; a map the user set would place it elsewhere), the user's ``device_map`` or the
    process's device otherwise, and the CPU where the process runs on the CPU (``use_cpu``, CPU DDP) or under
    DeepSpeed (refused by the config, kept as TRL does)."""
    if state.distributed_type == "DEEPSPEED" or state.device.type in ("cpu", "mps"):
        return None
    if state.distributed_type == "MULTI_GPU" or requested is None:
        return {"": state.device}
    return requested


def load_nvfp4_model(model_id: str, args: QeRLGRPOConfig, lora_config: Any = None) -> tuple[PreTrainedModel, bool]:
    """Load ``model_id`` with its Linears as NVFP4Linear (its config checked first); return
    ``(model, checkpoint_is_nvfp4a16)``."""
    from ..quantizer import NVFP4Config, load_nvfp4

    kwargs = dict(args.model_init_kwargs or {})
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    kwargs.setdefault("dtype", torch.bfloat16)
    kwargs["device_map"] = load_device_map(args.distributed_state, kwargs.get("device_map"))
    config = AutoConfig.from_pretrained(
        model_id, revision=kwargs.get("revision"), trust_remote_code=kwargs["trust_remote_code"]
    )
    check_architecture(config)
    check_vllm_layout(config, args)
    check_moe_lora(config, lora_config, args)
    qc = getattr(config, "quantization_config", None)
    qc = qc if isinstance(qc, dict) or qc is None else qc.to_dict()
    is_nvfp4 = is_nvfp4a16_config({"quantization_config": qc})
    if qc is not None and not is_nvfp4:
        raise ValueError(
            f"{model_id} is already quantized ({qc.get('quant_method')}, format {qc.get('format')}); QeRL needs "
            "a 16-bit checkpoint (quantized to NVFP4 on load) or a compressed-tensors NVFP4A16 one."
        )
    if is_nvfp4:  # packed tensors load as they are
        return load_nvfp4(model_id, **kwargs), True
    quant = NVFP4Config(modules_to_not_convert=args.nvfp4_modules_to_not_convert)
    return load_nvfp4(model_id, quantization_config=quant, **kwargs), False


def _base_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


# -- the checkpoint vLLM serves -------------------------------------------------------------------------------------


def _nvfp4_fingerprint(model: nn.Module, n_layers: int = 4, n_bytes: int = 4096) -> str:
    """Cheap content hash of a few packed FP4 weights (tells two instances with the same name apart)."""
    h = hashlib.sha256()
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, NVFP4Linear):
            packed = module.weight_packed.detach().reshape(-1)[:n_bytes].cpu()
            h.update(name.encode())
            h.update(str(tuple(module.weight_packed.shape)).encode())
            h.update(packed.numpy().tobytes())
            h.update(module.weight_global_scale.detach().float().cpu().numpy().tobytes())
            count += 1
            if count >= n_layers:
                break
    return h.hexdigest()[:16]


def server_checkpoint_hint(source: str | None, source_is_nvfp4: bool) -> str:
    """Server mode: what the server must serve (for messages): the NVFP4A16 checkpoint this trainer loaded, or
    the one ``qerl-trl quantize`` writes from its 16-bit model (byte-equal to the base quantized on load)."""
    if source is not None and source_is_nvfp4:
        return source
    logger.warning(
        "vllm_mode='server': the server must serve the NVFP4A16 checkpoint of this model, written by `qerl-trl "
        "quantize %s NVFP4_DIR` (byte-equal to the base this trainer quantized on load); training from that "
        "directory too rules out a mismatch.", source or "MODEL",
    )
    return "NVFP4_DIR"


def vllm_checkpoint(model: nn.Module, source: str | None, source_is_nvfp4: bool, processing_class: Any,
                    args: QeRLGRPOConfig) -> str:  # fmt: skip
    """The NVFP4A16 checkpoint vLLM serves: the user's own, or one written once into the cache dir."""
    if source is not None and source_is_nvfp4:
        return source
    base = _base_model(model)
    name = source or getattr(base.config, "_name_or_path", "") or type(base).__name__
    qc = getattr(base.config, "quantization_config", None)
    identity = {
        "name": name,
        "revision": (args.model_init_kwargs or {}).get("revision"),
        "commit": getattr(base.config, "_commit_hash", None),
        "fingerprint": _nvfp4_fingerprint(base),
    }
    options = {
        "quantization_config": qc.to_dict() if hasattr(qc, "to_dict") else qc,
        "modules_to_not_convert": args.nvfp4_modules_to_not_convert,
    }
    key = checkpoint_key(identity, options)

    def write(tmp: str) -> None:
        base.save_pretrained(tmp)
        processing_class.save_pretrained(tmp)

    from accelerate import PartialState

    state = PartialState()
    with state.local_main_process_first():
        path, written = ensure_cached_checkpoint(args.resolved_cache_dir, name, key, write)
    with open(os.path.join(path, "config.json")) as f:
        if not is_nvfp4a16_config(json.load(f)):
            raise RuntimeError(
                f"The checkpoint written to {path} is not a compressed-tensors NVFP4A16 checkpoint; the model's "
                "save_pretrained must come from qerl_trl's NVFP4 quantizer."
            )
    logger.info("vLLM serves the NVFP4A16 checkpoint %s (%s)", path, "written now" if written else "cached")
    return path
