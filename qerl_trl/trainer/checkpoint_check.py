"""Whether a training checkpoint can be resumed, checked before ``Trainer.train`` reads it, and which one to take.

Why: transformers writes ``checkpoint-N`` in place (the adapter, then the optimizer, scheduler and RNG state, then
``trainer_state.json``), and ``resume_from_checkpoint=True`` takes the highest N. A run killed during a save leaves a
half-written newest checkpoint, and resuming from it fails deep in safetensors ("header too small") or torch,
naming neither the file nor a checkpoint that would work. Here each file is checked first (sizes, headers, zip
CRCs, finite LoRA weights); ``True`` skips a broken newest checkpoint for the last complete one, with a warning, and
a named broken checkpoint is an error that names the file and the last checkpoint that loads. The AQN schedule's
position is ``trainer_state.json``'s ``global_step``, so a checkpoint without it cannot resume AQN either.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import zipfile

__all__ = ["checkpoint_problem", "checkpoints_newest_first", "resolve_resume_checkpoint"]

logger = logging.getLogger(__name__)

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
#: what every resumable checkpoint of a LoRA run holds (the adapter in one of two formats)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
TRAINER_STATE = "trainer_state.json"
#: written unless ``save_only_model``; torch zip archives
OPTIMIZER_FILES = ("optimizer.pt", "scheduler.pt")


def checkpoints_newest_first(folder: str) -> list[str]:
    """The ``checkpoint-N`` directories in ``folder``, highest N first."""
    if not os.path.isdir(folder):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(folder) if (m := _CHECKPOINT.match(name))]
    return [os.path.join(folder, name) for _, name in sorted(found, reverse=True)
            if os.path.isdir(os.path.join(folder, name))]  # fmt: skip


def _safetensors_problem(path: str) -> str | None:
    size = os.path.getsize(path)
    if size < 8:
        return f"{size} bytes, shorter than a safetensors header (truncated)"
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n > size:
            return f"its header claims {n} bytes but the file has {size} (truncated)"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "its header is not valid JSON (corrupt)"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    if 8 + n + max(ends, default=0) != size:
        return f"its tensors need {8 + n + max(ends, default=0)} bytes but the file has {size} (truncated)"
    import torch
    from safetensors.torch import load_file

    bad = [name for name, t in load_file(path).items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        return f"{len(bad)} tensors hold NaN or inf (e.g. {bad[0]}; corrupt)"
    return None


def _zip_problem(path: str) -> str | None:
    try:
        with zipfile.ZipFile(path) as z:
            broken = z.testzip()
    except (zipfile.BadZipFile, OSError) as e:
        return f"not a readable torch archive ({e}; truncated or corrupt)"
    return f"member {broken} fails its CRC check (corrupt)" if broken else None


def _json_problem(path: str, needs: tuple[str, ...] = ()) -> str | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except ValueError:
        return "not valid JSON (truncated or corrupt)"
    missing = [k for k in needs if k not in data]
    return f"has no {missing[0]!r}" if missing else None


def checkpoint_problem(path: str, needs_optimizer: bool = True) -> str | None:
    """What keeps ``path`` from being resumed, naming the file (``"<file>: <why>"``), or None if it loads."""
    if not os.path.isdir(path):
        return f"{path}: no such directory"
    state = os.path.join(path, TRAINER_STATE)
    if not os.path.isfile(state):
        return (f"{state}: missing (it is written last: the save did not finish; without it the step count and the "
                "AQN schedule cannot resume)")  # fmt: skip
    if why := _json_problem(state, ("global_step",)):
        return f"{state}: {why}"
    if not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        return f"{os.path.join(path, ADAPTER_CONFIG)}: missing"
    if why := _json_problem(os.path.join(path, ADAPTER_CONFIG)):
        return f"{os.path.join(path, ADAPTER_CONFIG)}: {why}"
    weights = [os.path.join(path, w) for w in ADAPTER_WEIGHTS if os.path.isfile(os.path.join(path, w))]
    if not weights:
        return f"{os.path.join(path, ADAPTER_WEIGHTS[0])}: missing"
    why = _safetensors_problem(weights[0]) if weights[0].endswith(".safetensors") else _zip_problem(weights[0])
    if why:
        return f"{weights[0]}: {why}"
    for name in OPTIMIZER_FILES if needs_optimizer else ():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{file}: missing"
        if why := _zip_problem(file):
            return f"{file}: {why}"
    for name in sorted(os.listdir(path)):
        if name.startswith("rng_state") and name.endswith(".pth") and (why := _zip_problem(os.path.join(path, name))):
            return f"{os.path.join(path, name)}: {why}"
    return None


def resolve_resume_checkpoint(resume: str | bool, output_dir: str, needs_optimizer: bool = True) -> str | bool:
    """The checkpoint ``Trainer.train(resume_from_checkpoint=resume)`` should read.

    ``True``: the newest ``checkpoint-N`` in ``output_dir`` that loads; newer broken ones are skipped with a warning
    that names the broken file (``True`` is passed through when there is none at all, for transformers' own error).
    A path: itself if it loads, else a ValueError that names the broken file and the last checkpoint beside it that
    loads. Nothing is deleted."""
    if resume is True:
        found = checkpoints_newest_first(output_dir)
        for path in found:
            why = checkpoint_problem(path, needs_optimizer)
            if why is None:
                return path
            logger.warning("Not resuming from %s: %s. Trying the checkpoint before it.", path, why)
        if found:
            raise ValueError(
                f"No checkpoint in {output_dir} can be resumed: the newest, {found[0]}, fails with "
                f"{checkpoint_problem(found[0], needs_optimizer)}; every older one fails too. Train without "
                "resume_from_checkpoint, or fix the files named above."
            )
        return True
    if not resume:
        return resume
    path = os.fspath(resume)
    why = checkpoint_problem(path, needs_optimizer)
    if why is None:
        return path
    others = [p for p in checkpoints_newest_first(os.path.dirname(os.path.abspath(path)))
              if os.path.abspath(p) != os.path.abspath(path)]  # fmt: skip
    fallback = next((p for p in others if checkpoint_problem(p, needs_optimizer) is None), None)
    hint = (f"The last checkpoint that loads is {fallback}: pass resume_from_checkpoint={fallback!r}."
            if fallback else "No other checkpoint beside it loads: train without resume_from_checkpoint.")  # fmt: skip
    raise ValueError(f"Cannot resume from {path}: {why}. {hint}")
