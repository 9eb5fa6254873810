"""Checkpoints: the compressed-tensors NVFP4A16 config we write, and reading NVFP4A16 checkpoints back packed.

We write exactly what llm-compressor writes for its ``NVFP4A16`` preset (compressed-tensors 0.17, the version
vLLM 0.24 pins): tensors ``<module>.weight_packed`` / ``.weight_scale`` / ``.weight_global_scale`` and a
``quantization_config`` with ``quant_method: "compressed-tensors"`` and ``format: "nvfp4-pack-quantized"``, so
vLLM serves the directory as NVFP4 with no conversion and transformers' own compressed-tensors path decompresses
it. No compressed-tensors import is needed here (it is a test dependency, used to check this config).
"""

from __future__ import annotations

import copy
import os
from typing import Any, Iterable

PACKED_SUFFIX = ".weight_packed"

#: Weight args of compressed-tensors' ``NVFP4A16`` preset, serialized as compressed-tensors 0.17 does.
NVFP4A16_WEIGHT_ARGS: dict[str, Any] = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "group_size": 16,
    "strategy": "tensor_group",
    "block_structure": None,
    "dynamic": False,
    "actorder": None,
    "scale_dtype": "torch.float8_e4m3fn",
    "zp_dtype": None,
    "observer": "memoryless_minmax",
    "observer_kwargs": {},
}


def compressed_tensors_config(ignore: Iterable[str]) -> dict[str, Any]:
    """The ``quantization_config`` of an NVFP4A16 checkpoint whose 16-bit Linears are ``ignore``."""
    return {
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": copy.deepcopy(NVFP4A16_WEIGHT_ARGS),
                "input_activations": None,
                "output_activations": None,
                "format": None,
            }
        },
        "format": "nvfp4-pack-quantized",
        "global_compression_ratio": None,
        "ignore": sorted(set(ignore)),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
    }


def _as_dict(qc: Any) -> dict[str, Any]:
    if isinstance(qc, dict):
        return qc
    if hasattr(qc, "to_dict"):
        return qc.to_dict()
    raise TypeError(f"unrecognised quantization_config {qc!r}")


def nvfp4a16_problems(qc: Any) -> list[str]:
    """Why ``qc`` is not a weight-only compressed-tensors NVFP4 config (empty list: it is one)."""
    d = _as_dict(qc)
    if d.get("quant_method") != "compressed-tensors":
        return [f"quant_method is {d.get('quant_method')!r}, not 'compressed-tensors'"]
    problems = []
    groups = d.get("config_groups") or {}
    if not groups:
        problems.append("it has no config_groups")
    if d.get("kv_cache_scheme"):
        problems.append("it quantizes the KV cache (kv_cache_scheme)")
    if d.get("sparsity_config") and d["sparsity_config"].get("format") not in (None, "dense"):
        problems.append("it is sparse (sparsity_config)")
    if d.get("quantization_status") not in (None, "compressed"):
        problems.append(f"quantization_status is {d.get('quantization_status')!r}, not 'compressed'")
    for name, g in groups.items():
        fmt = g.get("format") or d.get("format")
        if fmt != "nvfp4-pack-quantized":
            problems.append(f"{name}: format is {fmt!r}, not 'nvfp4-pack-quantized'")
        w = g.get("weights") or {}
        want = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
        for key, val in want.items():
            if w.get(key) != val:
                problems.append(f"{name}: weights.{key} is {w.get(key)!r}, expected {val!r}")
        if w.get("symmetric", True) is not True or w.get("dynamic", False) not in (False, None):
            problems.append(f"{name}: weights must be symmetric and static")
        if g.get("input_activations"):
            problems.append(
                f"{name}: it also quantizes input activations (NVFP4 W4A4); only weight-only NVFP4A16 is supported"
            )
        if g.get("output_activations"):
            problems.append(f"{name}: it quantizes output activations")
    return problems


def packed_modules(checkpoint_files: Iterable[str | os.PathLike] | None) -> set[str] | None:
    """Names of the modules stored packed (``<name>.weight_packed``) in safetensors files (headers only)."""
    if not checkpoint_files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for f in checkpoint_files:
        if not str(f).endswith(".safetensors"):
            return None
        with safe_open(os.fspath(f), framework="pt") as st:
            names.update(k[: -len(PACKED_SUFFIX)] for k in st.keys() if k.endswith(PACKED_SUFFIX))
    return names


def checkpoint_plan(checkpoint_dir: str | os.PathLike, modules_to_not_convert: Iterable[str] | None = None):
    """The ``ConversionPlan`` an NVFP4A16 checkpoint directory was written with, read back from its files.

    Packed modules come from the safetensors headers; each module in the config's ``ignore`` list gets the
    reason it stayed 16-bit (``conversion.keep_reason``; ``in_features`` from its ``.weight`` header). For
    ``qerl-trl quantize``'s summary.
    """
    import json

    from safetensors import safe_open

    from .conversion import KEEP_FP32, ConversionPlan, keep_reason

    root = os.fspath(checkpoint_dir)
    with open(os.path.join(root, "config.json")) as f:
        config = json.load(f)
    ignore = list((config.get("quantization_config") or {}).get("ignore") or [])
    files = sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(".safetensors"))
    in_features: dict[str, int] = {}
    for path in files:
        with safe_open(path, framework="pt") as st:
            for key in st.keys():
                if key.endswith(".weight") and key[: -len(".weight")] in ignore:
                    in_features[key[: -len(".weight")]] = st.get_slice(key).get_shape()[-1]
    plan = ConversionPlan(groups={name: (name,) for name in sorted(packed_modules(files) or ())})
    for name in ignore:
        is_head = name == "lm_head" or name.endswith(".lm_head")
        reason = keep_reason(
            name, in_features.get(name, 0), output_embedding=is_head, modules_to_not_convert=modules_to_not_convert
        )
        plan.kept[name] = reason or KEEP_FP32  # 16-bit with a packable shape: the model class kept it
    return plan


_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "trust_remote_code")


def load_nvfp4(pretrained_model_name_or_path: str | os.PathLike, *, model_class: Any = None, **kwargs: Any):
    """Load a causal LM with NVFP4 base weights, packed and ready for LoRA training, in one call.

    * a compressed-tensors NVFP4A16 checkpoint (written by ``save_pretrained`` here, or by llm-compressor) loads
      its packed tensors as they are, into ``NVFP4Linear`` modules (no dequantize/requantize round trip);
    * a 16-bit checkpoint is quantized while loading, as with ``quantization_config=NVFP4Config()``.

    ``model_class`` defaults to ``AutoModelForCausalLM``; other keyword arguments go to its ``from_pretrained``
    (e.g. ``dtype=torch.bfloat16, device_map="cuda"``; pass ``quantization_config=NVFP4Config(...)`` to choose
    which modules stay 16-bit when quantizing a 16-bit checkpoint). Any other kind of quantized checkpoint
    raises a ``ValueError`` that says what it is.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from .config import NVFP4Config

    model_class = model_class or AutoModelForCausalLM
    user_qc = kwargs.pop("quantization_config", None)
    if user_qc is not None and not isinstance(user_qc, NVFP4Config):
        raise TypeError(f"load_nvfp4 takes an NVFP4Config as quantization_config, got {type(user_qc).__name__}")
    config = kwargs.pop("config", None)
    if config is None:
        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub)
    text_config = config.get_text_config(decoder=True)
    holder = config if getattr(config, "quantization_config", None) is not None else text_config
    qc = getattr(holder, "quantization_config", None)
    if qc is None:
        return model_class.from_pretrained(
            pretrained_model_name_or_path, config=config, quantization_config=user_qc or NVFP4Config(), **kwargs
        )
    problems = nvfp4a16_problems(qc)
    if problems:
        raise ValueError(
            f"{pretrained_model_name_or_path} is not an NVFP4A16 (compressed-tensors nvfp4-pack-quantized, "
            f"weight-only) checkpoint: {'; '.join(problems)}. load_nvfp4 loads those or 16-bit checkpoints; "
            "load other quantized checkpoints with plain from_pretrained."
        )
    ours = NVFP4Config(
        modules_to_not_convert=None if user_qc is None else user_qc.modules_to_not_convert,
        fused_groups=None if user_qc is None else user_qc.fused_groups,
        checkpoint_ignore=_as_dict(qc).get("ignore") or [],
    )
    # A config whose quantization_config is ours makes transformers pick our quantizer with pre_quantized=True.
    config.quantization_config = ours.to_dict()
    if holder is not config and hasattr(text_config, "quantization_config"):
        text_config.quantization_config = ours.to_dict()
    return model_class.from_pretrained(pretrained_model_name_or_path, config=config, **kwargs)
