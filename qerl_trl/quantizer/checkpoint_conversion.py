"""Checkpoint conversion on disk: a 16-bit (or GGUF) checkpoint -> an NVFP4A16 compressed-tensors checkpoint.

What ``qerl-trl quantize`` runs, and what the demo and the comparison study call to make their NVFP4 bases. It
loads through :class:`~qerl_trl.quantizer.NVFP4Config` (one Linear at a time) and writes with transformers'
``save_pretrained``, so the result is exactly what :func:`~qerl_trl.quantizer.load_nvfp4` and vLLM read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["gguf_to_16bit", "quantize_checkpoint"]


def quantize_checkpoint(
    model: str,
    out_dir: str | os.PathLike,
    *,
    modules_to_not_convert: list[str] | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    gguf_file: str | None = None,
    max_shard_size: str = "5GB",
) -> Path:
    """Quantize a 16-bit checkpoint to an NVFP4A16 compressed-tensors checkpoint in ``out_dir``; return it.

    transformers loads the checkpoint through ``NVFP4Config``, which quantizes each Linear as its weights are
    read (so peak memory is about one layer in 16 bits plus the packed model; the loader's progress bar shows
    the layers), then ``save_pretrained`` writes the packed tensors and the tokenizer is copied alongside.
    A ``gguf_file`` (inside ``model``) is first dequantized to a temporary 16-bit checkpoint.

    The checkpoint is written into a hidden sibling (``.<name>.partial-<pid>``) and renamed to ``out_dir`` once
    complete, so a run killed halfway leaves no ``out_dir`` that a later run could take for a checkpoint; the next
    call removes what such a run left.
    """
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .config import NVFP4Config

    from ..model_source import check_model_source

    check_model_source(model, needs_config=not gguf_file)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: choose a new OUT_DIR (nothing was overwritten).")
    with tempfile.TemporaryDirectory(prefix="qerl-gguf-") as tmp:
        src = model
        if gguf_file:
            src = gguf_to_16bit(model, gguf_file, tmp)
        config = AutoConfig.from_pretrained(src, revision=revision, trust_remote_code=trust_remote_code)
        qc = getattr(config, "quantization_config", None)
        if qc is not None:
            method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", qc)
            raise ValueError(
                f"{model} is already quantized ({method}); `qerl-trl quantize` needs a 16-bit (bf16/fp16/fp32) "
                "checkpoint."
            )
        qmodel = AutoModelForCausalLM.from_pretrained(
            src,
            quantization_config=NVFP4Config(modules_to_not_convert=modules_to_not_convert),
            dtype=torch.bfloat16,
            revision=revision,
            trust_remote_code=trust_remote_code,
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_partials(out)
        partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
        qmodel.save_pretrained(str(partial), max_shard_size=max_shard_size)
        tokenizer = AutoTokenizer.from_pretrained(src, revision=revision, trust_remote_code=trust_remote_code)
        tokenizer.save_pretrained(str(partial))
        os.replace(partial, out)  # atomic; onto an empty out_dir too
    return out


def _remove_dead_partials(out: Path) -> None:
    """Remove the half-written ``.<name>.partial-<pid>`` siblings of ``out`` whose process is gone."""
    import shutil

    for partial in out.parent.glob(f".{out.name}.partial-*"):
        pid = partial.name.rpartition("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            print(f"Removing {partial}, left half-written by a quantize run that ended (pid {pid}).", flush=True)
            shutil.rmtree(partial, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def gguf_to_16bit(model_dir: str, gguf_file: str, out_dir: str | os.PathLike) -> str:
    """Dequantize a GGUF file into a bf16 transformers checkpoint (weights + tokenizer) in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    try:  # transformers >= 5.2x keeps GGUF blocks packed unless asked to dequantize; older ones always dequantize
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=torch.bfloat16, **kwargs)
    if getattr(model, "hf_quantizer", None) is not None:  # a plain dense model is what we save
        model.hf_quantizer = None
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    model.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file).save_pretrained(str(out_dir))
    return str(out_dir)
