"""QeRL's vLLM plugin: code that runs inside the vLLM engine.

vLLM loads :func:`register` through its ``vllm.general_plugins`` entry point (``pyproject.toml``) in every engine
process; QeRL's trainer also calls it before building its colocated engine. Importing this package does not import
vLLM; :mod:`.lora_shards` (the LoRA layout math) needs only torch.
"""

from __future__ import annotations

from .quant_spec import LORA_KEY, OTHER_BACKEND_HINT, QUANT_NAME, lora_quantization_overrides

__all__ = ["LORA_KEY", "OTHER_BACKEND_HINT", "QUANT_NAME", "lora_quantization_overrides", "register"]


def register(strict: bool = False) -> None:
    """Register the ``qerl_nvfp4_lora`` quantization method with vLLM, and the float32 AQN-norm hook (idempotent).

    vLLM calls this, unguarded, at every engine start of anyone who has qerl-trl installed, so by default a failure
    (another vLLM version, say) is logged and the engine starts without our method. QeRL's trainer, which needs the
    method, calls it with ``strict=True`` and gets the error.
    """
    try:
        from . import single_lora  # noqa: F401  (the decorator registers it)
        from .fp32_norms import install_fp32_norm_hook

        install_fp32_norm_hook()  # engines of `qerl-trl vllm-serve` list their AQN norms in the HF config
    except Exception:
        if strict:
            raise
        import logging

        logging.getLogger(__name__).exception(
            "qerl-trl: could not register the vLLM quantization method %r; vllm_lora_backend='qerl' will not work "
            "in this engine", QUANT_NAME,
        )
