"""The one place that bridges transformers' HfQuantizer API between 5.17 (the GPU machine's) and >= 5.21.

Written against transformers 5.17.0 and 5.23.0. What changed at 5.21 and how we stay on both sides:

* Parallel plans: 5.17 calls ``update_tp_plan(config)`` / ``update_ep_plan(config)`` from ``get_hf_quantizer``;
  >= 5.21 calls ``update_parallel_plan(model, plan)`` from ``preprocess_model``. Packed NVFP4 tensors have no
  sharding plan, so both refuse tensor/expert parallel loading with a clear error instead of mis-sharding.
* Pre-quantized dtypes: 5.17 loads a tensor in its checkpoint dtype when it is not floating point; >= 5.21 asks
  ``get_new_dtype``. Our packed uint8 / FP8 / FP32 tensors keep their dtypes under both rules (tested), so
  nothing to bridge; we rely on the module's own dtypes (uint8, float8_e4m3fn, float32).
* ``update_weight_conversions(weight_conversions)`` gained a ``model`` argument, and ``should_convert_module``
  changed its matching rules at 5.21: we override neither and match module names ourselves
  (``conversion.matches``), so the two versions select the same modules.
* transformers >= 5.23 registers its own ``"nvfp4"`` quant_method: ours is ``"qerl_nvfp4"`` (``config.py``).
"""

from __future__ import annotations

from typing import Any

import transformers
from packaging.version import Version

TRANSFORMERS_VERSION = Version(transformers.__version__)
#: the HfQuantizer API generation: ``update_parallel_plan`` and ``get_new_dtype`` exist from 5.21 on
PARALLEL_PLAN_API = TRANSFORMERS_VERSION >= Version("5.21.0.dev0")


def _refuse_parallel(what: str) -> None:
    raise NotImplementedError(
        f"NVFP4Config does not support {what} loading: packed NVFP4 tensors have no sharding plan. "
        "Load on one device per process (device_map='cuda' or a per-rank device) and use data parallelism."
    )


def _has_distributed(config: Any) -> bool:
    """Whether ``config`` asks for tensor or expert parallelism (``from_pretrained(distributed_config=...)``)."""
    dc = getattr(config, "distributed_config", None)
    tp = getattr(dc, "tp_size", None)
    return dc is not None and (bool(getattr(dc, "enable_expert_parallel", False)) or (isinstance(tp, int) and tp > 1))


class HfQuantizerCompat:
    """Mixin giving ``NVFP4HfQuantizer`` both generations of the parallel-plan hooks."""

    # transformers 5.17 (called with the model config, before the model exists)
    def update_tp_plan(self, config):
        if _has_distributed(config):
            _refuse_parallel("tensor-parallel")
        return config

    def update_ep_plan(self, config):
        if _has_distributed(config):
            _refuse_parallel("expert-parallel")
        return config

    # transformers >= 5.21 (called on the meta model with its full tp/ep plan)
    def update_parallel_plan(self, model, plan):
        if _has_distributed(model.config):
            _refuse_parallel("tensor/expert-parallel")


def register(config_cls: type, quantizer_cls: type, method: str) -> None:
    """Register ``method`` with transformers' public registries; a no-op when it is already ours (re-import)."""
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
        register_quantization_config,
        register_quantizer,
    )

    for mapping, cls, reg in (
        (AUTO_QUANTIZATION_CONFIG_MAPPING, config_cls, register_quantization_config),
        (AUTO_QUANTIZER_MAPPING, quantizer_cls, register_quantizer),
    ):
        existing = mapping.get(method)
        if existing is None:
            reg(method)(cls)
        elif existing.__module__ != cls.__module__ or existing.__qualname__ != cls.__qualname__:
            raise RuntimeError(f"quant_method {method!r} is already registered by {existing.__module__}")
        else:  # the same class from a reloaded module: point transformers at the current one
            mapping[method] = cls
