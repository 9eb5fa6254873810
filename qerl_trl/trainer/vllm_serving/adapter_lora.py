"""``vllm_lora_backend="vllm"``: the policy's LoRA served as a vLLM adapter (vLLM's own LoRA support, punica kernels).

Each round the adapter travels through a RAM-backed directory (``/dev/shm``) with vLLM's public ``LoRARequest`` /
``llm_engine.add_lora`` API; the files are deleted as soon as vLLM has loaded them, and only the newest adapter
stays loaded.
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


def write_adapter_dir(
    path: str, tensors: dict[str, torch.Tensor], peft_config: Any, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (the layout vLLM's loader reads)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg = peft_config.to_dict()
    cfg = json.loads(json.dumps(cfg, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(
        {k: v.to(device="cpu", dtype=dtype).contiguous() for k, v in tensors.items()},
        os.path.join(path, "adapter_model.safetensors"),
    )


class _AdapterPusher:
    """Pushes one adapter per round into the engine; only the newest one stays loaded.

    ``phases`` holds the last push's wall time by phase (``write``: the files in ``sync_dir``; ``load``: vLLM's
    ``remove_lora`` + ``add_lora``), so a slow sync says where its time went."""

    def __init__(self, llm: Any, sync_dir: str):
        self.llm = llm
        self.sync_dir = sync_dir
        self.current_id = 0
        self.phases: dict[str, float] = {}

    def push(self, tensors: dict[str, torch.Tensor], peft_config: Any):
        from vllm.lora.request import LoRARequest

        new_id = self.current_id + 1
        tmp = tempfile.mkdtemp(prefix=f"qerl-lora-{os.getpid()}-", dir=self.sync_dir)
        try:
            t0 = time.perf_counter()
            write_adapter_dir(tmp, tensors, peft_config)
            t1 = time.perf_counter()
            request = LoRARequest(lora_name=f"qerl-{new_id}", lora_int_id=new_id, lora_path=tmp)
            engine = self.llm.llm_engine
            if self.current_id:
                engine.remove_lora(self.current_id)
            engine.add_lora(request)  # loads the files now (to CPU; moved to the GPU slot on first use)
            self.phases = {"write": t1 - t0, "load": time.perf_counter() - t1}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.current_id = new_id
        return request


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
        self._pusher = _AdapterPusher(llm, self.spec.lora_sync_dir)

    def sync(self, model: nn.Module, gather_params: GatherParams) -> Any:
        t0 = time.perf_counter()
        with gather_params(self.lora_parameters(model)):
            tensors = {k: v.clone() for k, v in peft_to_vllm_lora_tensors(model).items()}
        read = time.perf_counter() - t0
        request = self._pusher.push(tensors, model.peft_config["default"])
        self.last_phases = {"read": read, **self._pusher.phases}
        return request

    def clear(self) -> int:
        if not self._pusher.current_id:
            return 0
        self.llm.llm_engine.remove_lora(self._pusher.current_id)
        self._pusher.current_id = 0
        return 1
