"""The interface of a LoRA backend: how the colocated vLLM engine serves the policy's LoRA on the FP4 base.

One class per backend, as PEFT has one LoRA layer class per backend: :class:`~.adapter_lora.AdapterLoRABackend`
(``vllm_lora_backend="vllm"``, vLLM's own LoRA adapters) and :class:`~.in_layer_lora.InLayerLoRABackend`
(``"qerl"``, the LoRA inside QeRL's quantization method). The generation class calls only these three methods,
plus :meth:`attach` once the engine is built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ClassVar

from torch import nn

from .serving_spec import VLLMServingSpec

__all__ = ["GatherParams", "VLLMLoRABackend"]

#: TRL's ``gather_params(params)`` context (ZeRO-3 gathers sharded LoRA tensors inside it; a no-op otherwise)
GatherParams = Callable[[list[nn.Parameter]], AbstractContextManager]


class VLLMLoRABackend(ABC):
    """Serves one PEFT LoRA (adapter ``"default"``) in a vLLM ``LLM``: engine arguments, a sync per round, a clear."""

    #: True when rollouts must pass a ``LoRARequest`` (the LoRA is a vLLM adapter), False when it is in the layers
    uses_lora_request: ClassVar[bool]

    def __init__(self, spec: VLLMServingSpec):
        self.spec = spec
        self.llm: Any = None
        #: the last sync's wall seconds by phase, where the backend splits it (the generation class logs them)
        self.last_phases: dict[str, float] = {}

    @abstractmethod
    def engine_kwargs(self, model: nn.Module) -> dict[str, Any]:
        """The LoRA's part of the ``LLM(...)`` arguments, for the policy ``model``."""

    def attach(self, llm: Any) -> None:
        """Remember the built engine (vLLM's ``LLM``, not TRL's proxy of it)."""
        self.llm = llm

    @abstractmethod
    def sync(self, model: nn.Module, gather_params: GatherParams) -> Any:
        """Serve ``model``'s current LoRA from now on; return the ``LoRARequest`` rollouts pass (or None)."""

    @abstractmethod
    def clear(self) -> int:
        """Serve the bare NVFP4 base (no LoRA) until the next sync; return how many LoRA modules or adapters were
        cleared. For checks that compare the engine with and without the LoRA."""

    @staticmethod
    def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
        return [p for n, p in model.named_parameters() if "lora_" in n]
