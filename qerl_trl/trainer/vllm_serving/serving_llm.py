"""The engine as TRL's ``VLLMGeneration.generate`` sees it: vLLM's ``LLM`` with the policy's LoRA request added."""

from __future__ import annotations

from typing import Any

__all__ = ["LoRAServingLLM"]

class LoRAServingLLM:
    """Proxy for a vLLM ``LLM`` used by TRL's ``VLLMGeneration.generate``.

    * ``generate`` gets ``lora_request=<current adapter>`` (so rollouts use the trained LoRA on the FP4 base);
    * ``sleep(level=2)`` becomes level 1: level 2 discards weights and its reload path breaks LoRA in vLLM 0.24.
    Everything else is forwarded unchanged.
    """

    def __init__(self, llm: Any, adapters: bool = True):
        self._llm = llm
        self.adapters = adapters  # False: the LoRA is built into the engine's layers (lora_backend="qerl")
        self.lora_request = None

    def generate(self, *args, **kwargs):
        if self.adapters and kwargs.get("lora_request") is None:
            if self.lora_request is None:
                raise RuntimeError("No LoRA adapter is loaded in vLLM: call sync_weights() first.")
            kwargs["lora_request"] = self.lora_request
        return self._llm.generate(*args, **kwargs)

    def sleep(self, level: int = 1, **kwargs):
        return self._llm.sleep(level=1, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._llm, name)
