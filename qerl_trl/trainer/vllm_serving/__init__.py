"""The trainer's vLLM side, one concern per module (written against TRL 1.16.0 and vLLM 0.24.0):

- :mod:`.versions`: the vLLM version check; :mod:`.lora_rules`: which LoRAs vLLM serves, at which rank;
- :mod:`.peft_tensors`: the policy's LoRA read out of PEFT;
- :mod:`.lora_backend`: the LoRA backend interface (engine arguments, sync, clear), implemented by
  :mod:`.adapter_lora` (``vllm_lora_backend="vllm"``: vLLM's adapters; :mod:`.adapter_refresh` refreshes a loaded
  one in place) and :mod:`.in_layer_lora` (``"qerl"``);
- :mod:`.fp4_kernel_choice`: the engine's FP4 kernel (Humming or Marlin) on this machine;
- :mod:`.fp32_norms`: AQN's float32 norms inside vLLM; :mod:`.compile_cache`: the compile-cache key for them;
- :mod:`.serving_spec`, :mod:`.serving_llm`, :mod:`.generation`: what the engine serves, the proxy TRL calls, and
  TRL's ``VLLMGeneration`` subclass with the swap that makes ``GRPOTrainer`` build it;
- server mode (``vllm_mode="server"``): :mod:`.server_command` (what ``qerl-trl vllm-serve`` starts, and what a
  trainer needs from a server) and :mod:`.server_sync` (the trainer's check of the server and its per-round sync).

Nothing here imports vLLM at import time.
"""

from __future__ import annotations

from .adapter_lora import AdapterLoRABackend, write_adapter_dir
from .compile_cache import compile_cache_marker
from .fp4_kernel_choice import require_humming_if_forced, resolve_fp4_kernel
from .fp32_norms import cast_norms_to_fp32, engine_norm_overrides, push_norm_weights
from .generation import LORA_BACKENDS, make_qerl_vllm_generation_class, swap_trl_vllm_generation
from .in_layer_lora import InLayerLoRABackend, single_lora_engine_kwargs
from .lora_backend import VLLMLoRABackend
from .lora_rules import VLLM_ALLOWED_LORA_RANKS, check_lora_config_for_vllm, vllm_max_lora_rank
from .peft_tensors import peft_lora_modules, peft_to_vllm_lora_tensors
from .serving_llm import LoRAServingLLM
from .serving_spec import VLLMServingSpec
from .versions import VLLM_MIN_VERSION, WRITTEN_AGAINST, require_vllm

__all__ = [
    "LORA_BACKENDS",
    "VLLM_ALLOWED_LORA_RANKS",
    "VLLM_MIN_VERSION",
    "WRITTEN_AGAINST",
    "AdapterLoRABackend",
    "InLayerLoRABackend",
    "LoRAServingLLM",
    "VLLMLoRABackend",
    "VLLMServingSpec",
    "cast_norms_to_fp32",
    "check_lora_config_for_vllm",
    "compile_cache_marker",
    "engine_norm_overrides",
    "make_qerl_vllm_generation_class",
    "peft_lora_modules",
    "peft_to_vllm_lora_tensors",
    "push_norm_weights",
    "require_humming_if_forced",
    "require_vllm",
    "resolve_fp4_kernel",
    "single_lora_engine_kwargs",
    "swap_trl_vllm_generation",
    "vllm_max_lora_rank",
    "write_adapter_dir",
]
