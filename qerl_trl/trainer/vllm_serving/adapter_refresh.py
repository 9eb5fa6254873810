"""A loaded vLLM adapter's weights replaced in place on the GPU: the ``"vllm"`` backend's sync after its first round.

vLLM's public path, ``llm_engine.add_lora`` on an adapter directory, rebuilds the adapter on the CPU every round:
it reads the files, pins every tensor (``pin_memory``, one call per tensor: 784 at Qwen2.5-7B with a LoRA on every
linear) and scales every B there. On an H200 at 7B that was 4.1 s a round of a 4.4 s sync (cProfile:
``sync_profile`` of the e2e rows). Here the round's tensors, already on the GPU, go through the same vLLM steps
(:meth:`LoRAModel.from_lora_tensors`, the packing of q/k/v and gate/up, the scaling, ``set_lora`` into the slot)
without the files, the CPU or the pinning, under the adapter id the engine already serves: its ``LoRARequest``
stays valid and nothing is read from disk again.

This is the one place that reaches into vLLM's LoRA internals. Written against vLLM 0.24.0
(``vllm/lora/worker_manager.py``, ``vllm/lora/model_manager.py``, ``vllm/lora/lora_model.py``,
``vllm/lora/peft_helper.py``); ``tests/test_trainer_vllm_lora.py`` checks on the CPU that those names still have
the shape used here.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["refresh_adapter_in_place"]


def refresh_adapter_in_place(worker: Any, lora_id: int, tensors: dict[str, torch.Tensor],
                             adapter_config: dict[str, Any]) -> int:  # fmt: skip
    """Run on the engine's worker (``llm_engine.collective_rpc``): replace the weights of the loaded adapter
    ``lora_id`` with ``tensors`` (PEFT's saved-adapter names, on the worker's device; vLLM scales B in place, so
    they must be the caller's copies) under ``adapter_config`` (the adapter's ``adapter_config.json``). Returns the
    number of LoRA modules refreshed."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    worker = getattr(worker, "worker", worker)  # vLLM's WorkerWrapperBase holds the worker
    loras = worker.model_runner.lora_manager  # WorkerLoRAManager (LRUCacheWorkerLoRAManager)
    manager = loras._adapter_manager  # LRUCacheLoRAModelManager
    if lora_id not in manager.list_adapters():
        raise RuntimeError(f"vLLM's engine has no adapter {lora_id} loaded to refresh; it has "
                           f"{sorted(manager.list_adapters())}.")  # fmt: skip
    helper = PEFTHelper.from_dict({**adapter_config, "vllm_max_position_embeddings": loras.max_position_embeddings})
    helper.validate_legal(loras.lora_config)
    model = manager.model
    lora = LoRAModel.from_lora_tensors(
        lora_id, tensors, helper, device=str(loras.device), dtype=loras.lora_config.lora_dtype,
        model_vocab_size=loras.vocab_size, weights_mapper=getattr(model, "hf_to_vllm_mapper", None),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )  # fmt: skip
    manager.remove_adapter(lora_id)  # frees its slot; the engine's request keeps the id
    manager.add_adapter(lora)  # packs q/k/v and gate/up, folds the scaling into B
    manager.activate_adapter(lora_id)  # set_lora: copies into the slot's GPU buffers
    return len(lora.loras)
