"""``vllm_lora_backend="vllm"``: the policy's LoRA served as a vLLM adapter (vLLM's own LoRA support, punica kernels).

The first round the adapter travels through a RAM-backed directory (``/dev/shm``) with vLLM's public
``LoRARequest`` / ``llm_engine.add_lora`` API, the files deleted as soon as vLLM has loaded them. Later rounds write
the new weights into that adapter on the GPU (:mod:`.adapter_refresh`; ``vllm_lora_sync_in_place=False``: a new
adapter through files every round, the older one removed).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

import torch
from torch import nn

from .lora_backend import GatherParams, VLLMLoRABackend
from .peft_tensors import peft_to_vllm_lora_tensors

__all__ = ["AdapterLoRABackend", "write_adapter_dir"]


def adapter_config_dict(peft_config: Any) -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` as a plain dict (sets as sorted lists)."""
    cfg = peft_config.to_dict()
    return json.loads(json.dumps(cfg, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))


def write_adapter_dir(
    path: str, tensors: dict[str, torch.Tensor], peft_config: Any, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (the layout vLLM's loader reads)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config_dict(peft_config), f)
    save_file(
        {k: v.to(device="cpu", dtype=dtype).contiguous() for k, v in tensors.items()},
        os.path.join(path, "adapter_model.safetensors"),
    )


class _AdapterPusher:
    """Pushes the adapter into the engine each round; only the newest one stays loaded.

    The first round (and the first after :meth:`clear`) goes through vLLM's public API: the files in ``sync_dir``,
    then ``add_lora``. Later rounds, with ``in_place``, write the new weights into that loaded adapter on the GPU
    (:func:`~.adapter_refresh.refresh_adapter_in_place`), under the same ``LoRARequest``; without it, each round is a
    new adapter through files, the previous one removed. ``phases`` holds the last push's wall time by phase
    (``write``: the files; ``load``: vLLM's load or the refresh), so a slow sync says where its time went."""

    def __init__(self, llm: Any, sync_dir: str, in_place: bool = False):
        self.llm = llm
        self.sync_dir = sync_dir
        self.in_place = in_place
        self.request: Any = None  #: the loaded adapter's request (None: none loaded)
        self.phases: dict[str, float] = {}

    def push(self, tensors: dict[str, torch.Tensor], peft_config: Any):
        if self.in_place and self.request is not None:
            from .adapter_refresh import refresh_adapter_in_place

            t0 = time.perf_counter()
            self.llm.llm_engine.collective_rpc(
                refresh_adapter_in_place, args=(self.request.lora_int_id, tensors, adapter_config_dict(peft_config))
            )
            self.phases = {"load": time.perf_counter() - t0}
            return self.request
        from vllm.lora.request import LoRARequest

        old_id = self.request.lora_int_id if self.request is not None else 0
        new_id = old_id + 1
        tmp = tempfile.mkdtemp(prefix=f"qerl-lora-{os.getpid()}-", dir=self.sync_dir)
        try:
            t0 = time.perf_counter()
            write_adapter_dir(tmp, tensors, peft_config)
            t1 = time.perf_counter()
            request = LoRARequest(lora_name=f"qerl-{new_id}", lora_int_id=new_id, lora_path=tmp)
            engine = self.llm.llm_engine
            if old_id:
                engine.remove_lora(old_id)
            engine.add_lora(request)  # loads the files now (to CPU; moved to the GPU slot on first use)
            self.phases = {"write": t1 - t0, "load": time.perf_counter() - t1}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.request = request
        return request

    def remove(self) -> int:
        """Unload the adapter (the next push loads one through files again); return how many were loaded."""
        if self.request is None:
            return 0
        self.llm.llm_engine.remove_lora(self.request.lora_int_id)
        self.request = None
        return 1


class AdapterLoRABackend(VLLMLoRABackend):
    """vLLM's LoRA adapters: ``enable_lora`` on the engine, one adapter pushed per round."""

    uses_lora_request = True

    def engine_kwargs(self, model: nn.Module) -> dict[str, Any]:
        kwargs = {"enable_lora": True, "max_lora_rank": self.spec.max_lora_rank, "max_loras": 1, "max_cpu_loras": 2}
        if self.spec.fp4_kernel == "humming":  # vLLM's Humming method reads the compressed-tensors checkpoint as it is
            kwargs["quantization"] = "humming"
        return kwargs

    def attach(self, llm: Any) -> None:
        super().attach(llm)
        self._pusher = _AdapterPusher(llm, self.spec.lora_sync_dir, self.spec.lora_sync_in_place)

    def sync(self, model: nn.Module, gather_params: GatherParams) -> Any:
        t0 = time.perf_counter()
        with gather_params(self.lora_parameters(model)):
            tensors = peft_to_vllm_lora_tensors(model, copy=True)
        read = time.perf_counter() - t0
        request = self._pusher.push(tensors, model.peft_config["default"])
        self.last_phases = {"read": read, **self._pusher.phases}
        return request

    def clear(self) -> int:
        return self._pusher.remove()
