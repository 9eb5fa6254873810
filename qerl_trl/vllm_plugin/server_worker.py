"""Server mode, the engine's side: what each worker of a ``vllm serve`` started by ``qerl-trl vllm-serve`` does when
the trainer syncs a round. Written against vLLM 0.24.0.

Why this mechanism (vLLM 0.24, TRL 1.16): TRL's server sync merges the LoRA into the base and streams every weight
over vLLM's NCCL weight-transfer engine into ``model.load_weights``; a packed FP4 base cannot take merged weights,
and ``load_weights`` has no route for QeRL's in-layer LoRA buffers. What moves each round is small (the LoRA, tens to
hundreds of MB, and AQN's norms, a few MB), so the trainer writes it to one safetensors file in a directory the
server can read (``/dev/shm`` on one host) and asks every worker, through vLLM's ``/collective_rpc`` (dev mode) and
this worker extension (``--worker-extension-cls``), to copy it into the layers in place. No NCCL group joins trainer
and server, so they can share a GPU. With ``vllm_lora_backend="vllm"`` the LoRA goes through vLLM's own runtime
LoRA loading (``/v1/load_lora_adapter``, the mechanism TRL's ``AsyncGRPOTrainer`` uses) and only the norms come here.

The round file's layout is in :mod:`.server_spec`. vLLM imports this module in its workers; importing it registers
QeRL's plugin in that process (see the end of the module).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .fp32_norms import FP32_NORMS_KEY, copy_norms_in_place
from .quant_spec import LORA_KEY
from .server_spec import SYNC_PROTOCOL, read_round

__all__ = ["QeRLServerWorker", "apply_round", "base_checksum"]


def apply_round(model: nn.Module, lora: Mapping, scaling: float, norms: Mapping, in_layer_lora: bool) -> dict:
    """Copy one round into vLLM's ``model`` in place: the LoRA into QeRL's single-LoRA layers (when the engine has
    them) and the noised norms. Returns what landed."""
    layers = 0
    if in_layer_lora:
        from .single_lora import push_lora_in_place

        layers = push_lora_in_place(model, lora, scaling)
    elif lora:
        raise ValueError("This server serves the LoRA as a vLLM adapter (vllm_lora_backend='vllm'); the round file "
                         "must not carry LoRA tensors.")  # fmt: skip
    return {"lora_layers": layers, "norms": copy_norms_in_place(model, norms)}


def base_checksum(model: nn.Module, skip: set[str] = frozenset()) -> str:
    """A checksum of every parameter of the served model (the packed FP4 weights and their scales, embeddings, the
    LM head) except LoRA tensors and ``skip`` (the AQN norms, which change every round): equal before and after
    training means the base was never written. Buffers are left out: kernels keep scratch there."""
    h = hashlib.sha256()
    for name, t in sorted(model.named_parameters(), key=lambda nt: nt[0]):
        if "lora" in name or name in skip or t.numel() == 0:
            continue
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        total, weighted = 0, 0
        for start in range(0, flat.numel(), 1 << 26):  # bounded temporary memory on the GPU
            chunk = flat[start : start + (1 << 26)].to(torch.int64)
            total += int(chunk.sum())
            weighted += int((chunk * (torch.arange(chunk.numel(), device=chunk.device) % 8191 + 1)).sum())
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:{total}:{weighted}".encode())
    return h.hexdigest()[:16]


class QeRLServerWorker:
    """vLLM worker extension (mixed into every worker by ``--worker-extension-cls``); the trainer calls its methods
    through ``POST /collective_rpc`` (string arguments only, results as JSON)."""

    def _qerl_fp32_norms(self) -> list[str]:
        hf_config = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        return list(getattr(hf_config, FP32_NORMS_KEY, None) or [])

    def qerl_describe(self, probe_path: str = "") -> dict[str, Any]:
        """What this worker serves, for the trainer's check before training: the sync protocol, the in-layer LoRA
        spec, vLLM's LoRA settings, which AQN norms are float32, and whether it can read ``probe_path`` (a file the
        trainer just wrote into its sync directory)."""
        from vllm import envs

        model = self.get_model()  # type: ignore[attr-defined]
        params = dict(model.named_parameters())
        quant = self.vllm_config.quant_config  # type: ignore[attr-defined]
        lora_config = self.vllm_config.lora_config  # type: ignore[attr-defined]
        in_layer = any(hasattr(m, "qerl_lora_plan") for m in model.modules())
        spec = None
        if in_layer:
            spec = {"rank": int(quant.lora_rank), "target_modules": sorted(quant.lora_targets),
                    "fp4_kernel": quant.fp4_kernel}  # fmt: skip
        return {
            "protocol": SYNC_PROTOCOL,
            "spec_key": LORA_KEY,
            "in_layer_lora": spec,
            "vllm_lora": None if lora_config is None else {"max_lora_rank": int(lora_config.max_lora_rank),
                                                           "max_loras": int(lora_config.max_loras)},  # fmt: skip
            "runtime_lora_updating": bool(envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING),
            "fp32_norms": sorted(n for n in self._qerl_fp32_norms()
                                 if n in params and params[n].dtype == torch.float32),  # fmt: skip
            "can_read_probe": bool(probe_path) and os.path.isfile(probe_path),
            "tp_rank": int(getattr(self, "rank", 0)),
        }

    def qerl_load_round(self, path: str) -> dict[str, Any]:
        """Copy the round file at ``path`` into the model in place; return the counts and the round id it read."""
        lora, scaling, norms, round_id = read_round(path)
        model = self.get_model()  # type: ignore[attr-defined]
        in_layer = any(hasattr(m, "qerl_lora_plan") for m in model.modules())
        landed = apply_round(model, lora, scaling, norms, in_layer)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {**landed, "round": round_id}

    def qerl_base_checksum(self) -> str:
        """:func:`base_checksum` of this worker's shard of the model."""
        return base_checksum(self.get_model(), set(self._qerl_fp32_norms()))  # type: ignore[attr-defined]


def _register_in_this_process() -> None:
    """vLLM imports this module in every worker (``--worker-extension-cls``) before it loads the model: register
    QeRL's plugin there (the float32 AQN-norm hook included) even where qerl-trl's ``vllm.general_plugins`` entry
    point is not installed, e.g. when it runs from a source tree."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        from . import register

        register()


_register_in_this_process()
