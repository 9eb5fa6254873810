"""Server mode: what the trainer and the server's worker extension (:mod:`.server_worker`) agree on. Imports no vLLM.

The round file: one safetensors file per generation round with ``lora_a.<module>`` / ``lora_b.<module>`` (vLLM's
module names, full unsharded tensors) and ``norm.<parameter>`` (AQN's noised norms), the LoRA scaling and the sync
protocol in its metadata, and the round's id: each worker returns the id it read, which shows it read this round's
file without hashing hundreds of MB on the sync path. The trainer writes it (:func:`write_round`), every worker reads
it (:func:`read_round`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

__all__ = ["SYNC_PROTOCOL", "WORKER_EXTENSION", "read_round", "round_tensors", "write_round"]

#: the ``--worker-extension-cls`` value
WORKER_EXTENSION = "qerl_trl.vllm_plugin.server_worker.QeRLServerWorker"
#: bumped when the round file or the RPC methods change; the trainer refuses a server that speaks another version
SYNC_PROTOCOL = 2


def round_tensors(
    lora: Mapping[str, tuple[torch.Tensor, torch.Tensor]], norms: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The round file's tensors (CPU, contiguous): ``lora_a.<m>``, ``lora_b.<m>`` per LoRA module, ``norm.<p>``."""
    out: dict[str, torch.Tensor] = {}
    for name, (a, b) in lora.items():
        out[f"lora_a.{name}"] = a.detach().to("cpu").contiguous()
        out[f"lora_b.{name}"] = b.detach().to("cpu").contiguous()
    for name, w in norms.items():
        out[f"norm.{name}"] = w.detach().to("cpu").contiguous()
    return out


def read_round(path: str) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float, dict[str, torch.Tensor], str]:
    """``(lora, scaling, norms, round id)`` from a round file written by the trainer."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        for key in f.keys():
            tensors[key] = f.get_tensor(key)
    if int(meta.get("protocol", -1)) != SYNC_PROTOCOL:
        raise ValueError(f"{path} was written with sync protocol {meta.get('protocol')}, this server speaks "
                         f"{SYNC_PROTOCOL}: install the same qerl-trl on the trainer and the server.")  # fmt: skip
    lora = {k.removeprefix("lora_a."): (v, tensors[f"lora_b.{k.removeprefix('lora_a.')}"])
            for k, v in tensors.items() if k.startswith("lora_a.")}  # fmt: skip
    norms = {k.removeprefix("norm."): v for k, v in tensors.items() if k.startswith("norm.")}
    return lora, float(meta.get("scaling", 1.0)), norms, meta.get("round", "")


def write_round(path: str, tensors: Mapping[str, torch.Tensor], scaling: float, round_id: str) -> None:
    """Write the round file atomically (a reader never sees half a file): a temporary name, then a rename."""
    from safetensors.torch import save_file

    tmp = f"{path}.tmp-{os.getpid()}"
    meta = {"protocol": str(SYNC_PROTOCOL), "scaling": repr(float(scaling)), "round": round_id}
    save_file(dict(tensors), tmp, metadata=meta)
    os.replace(tmp, path)
