"""Server mode: what a vLLM server must serve for QeRL's trainer, and the ``vllm serve`` command that serves it.

``qerl-trl vllm-serve MODEL`` builds its command here (:func:`serve_command`); the trainer compares what a running
server reports with its own :class:`ServerRequirements` (:mod:`.server_sync`) and, on a mismatch, prints
:func:`serve_hint`, the command that would serve it. Both sides resolve the LoRA targets and AQN's norms with the
trainer's own rules (PEFT's target matching, :func:`qerl_trl.aqn.find_noise_targets`), run here on a model of the
checkpoint's architecture and depth with tiny widths, so they agree without loading any weight.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Any

from ...vllm_plugin.fp32_norms import FP32_NORMS_KEY
from ...vllm_plugin.quant_spec import QUANT_NAME, lora_quantization_overrides
from ...vllm_plugin.server_spec import WORKER_EXTENSION
from .compile_cache import compile_cache_marker
from .lora_rules import vllm_max_lora_rank

__all__ = ["POLICY_LORA_NAME", "ServerRequirements", "requirements_for_checkpoint", "serve_command", "serve_hint",
           "vllm_serve_command"]

#: the adapter name a server with vLLM's LoRA serves the policy under (``vllm_lora_backend="vllm"``), with the
#: trainer run's id and the round
POLICY_LORA_NAME = "qerl-policy"


@dataclass(frozen=True)
class ServerRequirements:
    """What the trainer needs from the server: how it serves the LoRA, at which rank on which modules, and which
    norm weights AQN pushes (kept float32 in the engine)."""

    lora_backend: str  # "qerl" (in-layer) or "vllm" (vLLM's adapters)
    lora_rank: int
    lora_targets: tuple[str, ...]  # leaf module names, sorted
    fp32_norms: tuple[str, ...]  # vLLM parameter names, sorted; empty without AQN

    def cli_options(self) -> list[str]:
        """The ``qerl-trl vllm-serve`` options that ask for exactly this."""
        opts = ["--lora-backend", self.lora_backend, "--lora-r", str(self.lora_rank),
                "--lora-target-modules", *self.lora_targets]  # fmt: skip
        return opts + ([] if self.fp32_norms else ["--no-aqn"])


def _structure_model(config: Any):
    """A model with the checkpoint's architecture and layer count at tiny widths (random weights, float32, CPU):
    enough for PEFT's target matching and AQN's structure search, which depend on the module tree only."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    for key, value in {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}.items():  # fmt: skip
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.pad_token_id = None  # may lie outside the tiny vocabulary
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def requirements_for_checkpoint(
    checkpoint: str, lora_backend: str, lora_r: int, lora_target_modules: list[str] | str, aqn: bool
) -> ServerRequirements:
    """The requirements a trainer with this LoRA and AQN setting will have, from the checkpoint's config alone."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig

    from ...aqn import find_noise_targets, vllm_param_name
    from .peft_tensors import lora_target_leaves

    config = AutoConfig.from_pretrained(checkpoint)
    model = _structure_model(config)
    norms = tuple(sorted(vllm_param_name(t) for t in find_noise_targets(model))) if aqn else ()
    targets = lora_target_modules if isinstance(lora_target_modules, str) else list(lora_target_modules)
    peft_model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules=targets))
    return ServerRequirements(lora_backend, int(lora_r), lora_target_leaves(peft_model), norms)


def serve_command(
    checkpoint: str,
    req: ServerRequirements,
    fp4_kernel: str,
    *,
    host: str = "0.0.0.0",
    port: int = 8000,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    max_lora_rank: int | None = None,
    enforce_eager: bool = False,
    extra: list[str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment additions)`` of the ``vllm serve`` that serves ``checkpoint`` (NVFP4A16) for ``req``.

    ``fp4_kernel``: ``"humming"`` or ``"marlin"``, resolved on the server's machine. What it sets and why:

    * the LoRA: ``"qerl"``: QeRL's quantization method with the LoRA spec in ``--hf-overrides``; ``"vllm"``:
      ``--enable-lora`` at ``max_lora_rank`` with one adapter slot, and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``;
    * AQN: the norms kept float32 (``--hf-overrides``), and a compile-cache marker (``--additional-config``);
    * the round sync: the worker extension, and ``VLLM_SERVER_DEV_MODE=1`` for ``/collective_rpc``;
    * TRL's settings: ``--logprobs-mode processed_logprobs`` (importance sampling) and ``--max-logprobs -1``.
    """
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    overrides: dict[str, Any] = {}
    args = [sys.executable, "-m", "qerl_trl.vllm_plugin.serve_entry", "serve", checkpoint,
            "--host", host, "--port", str(port), "--tensor-parallel-size", str(tensor_parallel_size),
            "--gpu-memory-utilization", str(gpu_memory_utilization), "--dtype", "bfloat16"]  # fmt: skip
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if req.lora_backend == "qerl":
        overrides.update(lora_quantization_overrides(config, req.lora_rank, req.lora_targets, fp4_kernel))
        args += ["--quantization", QUANT_NAME]
    elif req.lora_backend == "vllm":
        rank = vllm_max_lora_rank(req.lora_rank, max_lora_rank)
        args += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1", "--max-cpu-loras", "2"]
        if fp4_kernel == "humming":
            args += ["--quantization", "humming"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    else:
        raise ValueError(f"lora_backend must be 'qerl' or 'vllm', got {req.lora_backend!r}.")
    if req.fp32_norms:
        overrides[FP32_NORMS_KEY] = list(req.fp32_norms)
    if overrides:
        args += ["--hf-overrides", json.dumps(overrides)]
    marker = compile_cache_marker(req.fp32_norms, overrides or None)
    args += ["--additional-config", json.dumps(marker), "--worker-extension-cls", WORKER_EXTENSION,
             "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]  # fmt: skip
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    if enforce_eager:
        args += ["--enforce-eager"]
    # the engine processes import qerl_trl (the worker extension, the pickled quantization config)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in [package_root, os.environ.get("PYTHONPATH", "")] if p)
    return args + list(extra or []), env


def serve_hint(checkpoint: str, req: ServerRequirements) -> str:
    """The ``qerl-trl vllm-serve`` command line that serves what ``req`` asks for."""
    return shlex.join(["qerl-trl", "vllm-serve", checkpoint, *req.cli_options()])


def _local_nvfp4_checkpoint(model: str, revision: str | None = None) -> str:
    """The local directory of ``model`` (a Hub id is downloaded, as vLLM would), checked to be NVFP4A16."""
    from ...model_source import check_model_source
    from ..nvfp4_cache import is_nvfp4a16_config

    check_model_source(model)
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(model, revision=revision)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if not is_nvfp4a16_config(config):
        raise ValueError(
            f"{model} is not an NVFP4A16 checkpoint. The server and the trainer must share one FP4 base: write it "
            f"with `qerl-trl quantize {model} NVFP4_DIR`, then run `qerl-trl vllm-serve NVFP4_DIR` and train from "
            "NVFP4_DIR."
        )
    return path


def vllm_serve_command(
    model: str,
    *,
    lora_backend: str = "qerl",
    lora_r: int = 32,
    lora_target_modules: list[str] | str = "all-linear",
    aqn: bool = True,
    fp4_kernel: str = "auto",
    revision: str | None = None,
    **server_options: Any,
) -> tuple[list[str], dict[str, str], ServerRequirements]:
    """What ``qerl-trl vllm-serve`` runs: ``(argv, environment additions, requirements)`` for serving ``model`` (an
    NVFP4A16 checkpoint) to trainers with this LoRA and AQN setting. ``server_options``: :func:`serve_command`'s."""
    from transformers import AutoConfig

    from .fp4_kernel_choice import require_humming_if_forced, resolve_fp4_kernel
    from .parallel_rules import check_tensor_parallel_layout

    if isinstance(lora_target_modules, (list, tuple)) and len(lora_target_modules) == 1:
        lora_target_modules = lora_target_modules[0] if lora_target_modules[0] == "all-linear" else list(
            lora_target_modules)
    require_humming_if_forced(fp4_kernel)
    path = _local_nvfp4_checkpoint(model, revision)
    tp = server_options.get("tensor_parallel_size", 1)
    check_tensor_parallel_layout(AutoConfig.from_pretrained(path), tp, option="--tensor-parallel-size")
    req = requirements_for_checkpoint(path, lora_backend, lora_r, lora_target_modules, aqn)
    kernel = resolve_fp4_kernel(fp4_kernel, lora_backend, path, tp).kernel
    argv, env = serve_command(path, req, kernel, **server_options)
    return argv, env, req
