"""QeRL's vLLM plugin: code that runs inside the vLLM engine.

vLLM loads :func:`register` through its ``vllm.general_plugins`` entry point (``pyproject.toml``) in every engine
process; QeRL's trainer also calls it before building its colocated engine. Importing this package does not import
vLLM; :mod:`.lora_shards` (the LoRA layout math) needs only torch.
"""

from __future__ import annotations


def register() -> None:
    """Register the ``qerl_nvfp4_lora`` quantization method with vLLM (idempotent)."""
    from . import single_lora  # noqa: F401  (the decorator registers it)
