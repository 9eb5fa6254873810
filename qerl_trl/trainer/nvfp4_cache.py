"""The NVFP4A16 checkpoint vLLM serves: reused when the user gave one, else written once to a keyed cache dir.

The cache key hashes the model's identity (name or path, revision, commit hash when known) and every
quantization option, so changing any of them writes a new checkpoint; an existing complete one is reused. Writes
are atomic: the checkpoint is written to a temporary directory next to its final place and renamed, so a crash
or a concurrent writer never leaves a half-written checkpoint that a later run would serve.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from typing import Any, Callable

__all__ = ["is_nvfp4a16_config", "checkpoint_key", "ensure_cached_checkpoint", "COMPLETE_MARKER"]

COMPLETE_MARKER = ".qerl_complete"
_FORMAT_VERSION = 1


def is_nvfp4a16_config(config_dict: dict | None) -> bool:
    """True if a config.json dict describes a compressed-tensors NVFP4 (weights-only) checkpoint."""
    qc = (config_dict or {}).get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        return False
    if qc.get("format") == "nvfp4-pack-quantized":
        return True
    groups = qc.get("config_groups") or {}
    return any((g or {}).get("format") == "nvfp4-pack-quantized" for g in groups.values())


def checkpoint_key(identity: dict[str, Any], options: dict[str, Any]) -> str:
    """A short stable hash of the model identity and the quantization options."""
    blob = json.dumps(
        {"identity": identity, "options": options, "format": _FORMAT_VERSION}, sort_keys=True, default=str
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "--", name.strip("/"))[-80:] or "model"


def ensure_cached_checkpoint(
    cache_root: str, name: str, key: str, write: Callable[[str], None]
) -> tuple[str, bool]:
    """Return ``(path, written)``: the cached checkpoint for ``key``, calling ``write(tmp_dir)`` only if missing.

    ``write`` must fill ``tmp_dir`` with the full checkpoint (config, safetensors, tokenizer). The directory is
    renamed into place only after ``write`` returns; if another process won the race, its copy is kept.
    """
    os.makedirs(cache_root, exist_ok=True)
    final = os.path.join(cache_root, f"{_slug(name)}-{key}")
    if os.path.exists(os.path.join(final, COMPLETE_MARKER)):
        return final, False
    tmp = tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=cache_root)
    try:
        write(tmp)
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            json.dump({"key": key, "name": name}, f)
        if os.path.exists(final) and not os.path.exists(os.path.join(final, COMPLETE_MARKER)):
            shutil.rmtree(final, ignore_errors=True)  # a stale partial dir from an old crash (not ours to keep)
        try:
            os.rename(tmp, final)
        except OSError:
            if os.path.exists(os.path.join(final, COMPLETE_MARKER)):
                return final, False  # a concurrent writer finished first
            raise
        return final, True
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
