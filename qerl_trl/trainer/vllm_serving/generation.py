"""The one place that reaches into TRL's vLLM generation. Written against TRL 1.16.0 and vLLM 0.24.0.

Why it exists: TRL 1.16 syncs a PEFT policy to vLLM by merging the LoRA into the base and pushing every tensor
(``VLLMGeneration._iter_named_params`` / ``sync_weights``), which cannot work on a packed FP4 base. Here the base
stays frozen inside vLLM and only the LoRA (and AQN's norms) move:

* ``QeRLVLLMGeneration`` subclasses TRL's ``trl.generation.vllm_generation.VLLMGeneration`` and overrides
  ``_init_vllm`` (build the one colocated ``LLM`` on the NVFP4A16 checkpoint, with the LoRA backend's engine
  arguments; in server mode, connect to a server started by ``qerl-trl vllm-serve`` and check it, see
  :mod:`.server_sync`) and ``sync_weights`` (the backend syncs the LoRA, then the AQN-noised norms, then the prefix
  cache is reset; in server mode the same through the server). TRL's ``generate`` is reused unchanged; the engine
  it calls is a ``LoRAServingLLM`` proxy that adds ``lora_request=`` and maps sleep level 2 (which TRL 1.16
  hard-codes, and which breaks LoRA) to level 1.
* ``swap_trl_vllm_generation`` swaps the ``VLLMGeneration`` name that ``trl.trainer.grpo_trainer`` instantiates in
  ``GRPOTrainer.__init__``, so only one engine is ever built.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable, Iterator

import torch

from .adapter_lora import AdapterLoRABackend
from .compile_cache import compile_cache_marker
from .fp32_norms import engine_norm_overrides, push_norm_weights
from .in_layer_lora import InLayerLoRABackend
from .lora_backend import VLLMLoRABackend
from .serving_llm import LoRAServingLLM
from .serving_spec import VLLMServingSpec
from .versions import WRITTEN_AGAINST

logger = logging.getLogger(__name__)

__all__ = ["LORA_BACKENDS", "make_qerl_vllm_generation_class", "swap_trl_vllm_generation"]

#: ``QeRLGRPOConfig.vllm_lora_backend`` -> the class that serves the LoRA that way
LORA_BACKENDS: dict[str, type[VLLMLoRABackend]] = {"vllm": AdapterLoRABackend, "qerl": InLayerLoRABackend}


def make_qerl_vllm_generation_class():
    """Build ``QeRLVLLMGeneration`` (a subclass of TRL 1.16's ``VLLMGeneration``); imported lazily with vLLM."""
    from trl.generation.vllm_generation import VLLMGeneration, empty_cache
    from trl.trainer.utils import ensure_master_addr_port

    class QeRLVLLMGeneration(VLLMGeneration):
        """TRL's colocated vLLM backend, serving the NVFP4 base + the policy LoRA through a LoRA backend."""

        serving: VLLMServingSpec

        def __init__(self, *args, serving: VLLMServingSpec, **kwargs):
            self.serving = serving
            self.lora_backend = LORA_BACKENDS[serving.lora_backend](serving)
            self.pending_norms: dict[str, torch.Tensor] | None = None
            self.last_sync_seconds = 0.0
            self.last_sync_phases: dict[str, float] = {}
            self.engine_start_seconds = 0.0
            super().__init__(*args, **kwargs)

        def _init_vllm(self):
            from vllm import LLM

            if self.mode == "server":
                return self._connect_server()
            accelerator = self.accelerator  # tensor_parallel_size divides the process count: the trainer checked
            if self.tensor_parallel_size > 1:
                self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                    [
                        list(range(i * self.tensor_parallel_size, (i + 1) * self.tensor_parallel_size))
                        for i in range(accelerator.num_processes // self.tensor_parallel_size)
                    ]
                )
            os.environ["RANK"] = str(accelerator.process_index)
            os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
            os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
            ensure_master_addr_port()
            spec = self.serving
            engine_lora = self.lora_backend.engine_kwargs(self.model)
            # AQN's norms kept float32 by the plugin's load hook, as in a `qerl-trl vllm-serve` engine
            overrides = engine_norm_overrides(spec.fp32_norm_names, engine_lora.pop("hf_overrides", None))
            routing = {"enable_return_routed_experts": True} if spec.return_routed_experts else {}
            t0 = time.perf_counter()
            llm = LLM(
                model=spec.checkpoint,
                tokenizer=spec.tokenizer,
                dtype=spec.dtype,
                tensor_parallel_size=self.tensor_parallel_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                max_model_len=self.max_model_length,
                max_num_seqs=self.max_num_seqs,
                enable_sleep_mode=self.enable_sleep_mode,
                model_impl=self.model_impl,
                distributed_executor_backend="external_launcher",
                seed=accelerator.process_index // self.tensor_parallel_size,
                max_num_batched_tokens=4096,
                logprobs_mode="processed_logprobs",
                trust_remote_code=self.trust_remote_code,
                enforce_eager=spec.enforce_eager,
                hf_overrides=overrides,
                additional_config=compile_cache_marker(spec.fp32_norm_names, overrides),
                **engine_lora,
                **routing,
            )
            self.engine_start_seconds = time.perf_counter() - t0
            logger.info("vLLM engine started in %.1f s (FP4 kernel: %s, LoRA backend: %s)", self.engine_start_seconds,
                        spec.fp4_kernel, spec.lora_backend)  # fmt: skip
            self.llm = LoRAServingLLM(llm, adapters=self.lora_backend.uses_lora_request)
            self.lora_backend.attach(llm)
            if self.enable_sleep_mode:
                self.llm.sleep(level=1)
            self._llm_weights_sleeping = self.enable_sleep_mode
            accelerator.wait_for_everyone()

        def _connect_server(self) -> None:
            """Server mode: TRL's client without its NCCL weight-transfer group (nothing but the LoRA and the norms
            ever moves), and the check that the server serves this policy. Every rank raises the main process's
            error, so none waits in a collective for a rank that stopped."""
            from accelerate.utils import broadcast_object_list
            from trl.generation.vllm_client import VLLMClient

            from .peft_tensors import lora_target_leaves
            from .server_command import ServerRequirements
            from .server_sync import ServerSync

            accelerator = self.accelerator
            spec = self.serving
            req = ServerRequirements(spec.lora_backend, int(self.model.peft_config["default"].r),
                                     lora_target_leaves(self.model),
                                     tuple(sorted(spec.fp32_norm_names)))  # fmt: skip
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            error = None
            if accelerator.is_main_process:
                try:
                    self.vllm_client = VLLMClient(base_url=base_url, group_port=self.group_port,
                                                  connection_timeout=self.server_timeout)  # fmt: skip
                    self.server_sync = ServerSync(base_url, req, spec.lora_sync_dir, spec.checkpoint)
                    self.server_sync.check()
                except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                    error = f"{type(e).__name__}: {e}"
            errors = [error]
            if accelerator.num_processes > 1:
                broadcast_object_list(errors, from_process=0)
            if errors[0] is not None:
                raise RuntimeError(errors[0])

        def _sync_server(self) -> None:
            """Server mode: the main process sends the LoRA and the round's norms (inside TRL's ``gather_params``,
            as the colocated backends do: a no-op without sharded parameters)."""
            with self._dist.gather_params(self.lora_backend.lora_parameters(self.model)):
                if self.accelerator.is_main_process:
                    self.server_sync.sync(self.model, self.pending_norms)
                    if self.server_sync.served_name is not None:  # vLLM's adapters: this round's adapter
                        self.vllm_client.model = self.server_sync.served_name  # TRL's requests name the model
                    self.vllm_client.reset_prefix_cache()
            self.pending_norms = None

        def sync_weights(self):
            """Sync the current LoRA (through the LoRA backend) and the pending AQN norms; never touch the FP4 base."""
            t0 = time.perf_counter()
            if self.mode == "server":
                self._sync_server()
                self.last_sync_seconds = time.perf_counter() - t0
                return
            phases: dict[str, float] = {}
            if self.enable_sleep_mode and self._llm_weights_sleeping:
                empty_cache()
                self.llm.wake_up(tags=["weights"])
                phases["wake_up"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            self.lora_backend.last_phases = {}
            request = self.lora_backend.sync(self.model, self._dist.gather_params)
            if self.lora_backend.uses_lora_request:
                self.llm.lora_request = request
            phases.update(self.lora_backend.last_phases or {"lora": time.perf_counter() - t1})
            t1 = time.perf_counter()
            if self.pending_norms:
                push_norm_weights(self.llm, self.pending_norms)
                self.pending_norms = None
            self.llm.reset_prefix_cache()
            # Level-1 sleep keeps the weights (offloaded to CPU); TRL's generate() must not re-sync.
            self._llm_weights_sleeping = False
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            phases["norms_and_cache"] = time.perf_counter() - t1
            self.last_sync_seconds = time.perf_counter() - t0
            self.last_sync_phases = {k: round(v, 4) for k, v in phases.items()}
            logger.debug("vLLM sync %.3f s by phase: %s", self.last_sync_seconds, self.last_sync_phases)

        def clear_lora(self) -> int:
            """Serve the bare NVFP4 base (no LoRA) until the next sync; for checks (colocate mode)."""
            if self.mode == "server":
                raise NotImplementedError("clear_lora() is a check of the colocated engine; not in server mode.")
            n = self.lora_backend.clear()
            if self.lora_backend.uses_lora_request:
                self.llm.lora_request = None
            return n

    return QeRLVLLMGeneration


@contextlib.contextmanager
def swap_trl_vllm_generation(factory: Callable[..., Any]) -> Iterator[None]:
    """During ``GRPOTrainer.__init__`` (TRL 1.16), make ``VLLMGeneration(...)`` build ``factory(...)`` instead."""
    from trl.trainer import grpo_trainer

    if not hasattr(grpo_trainer, "VLLMGeneration"):
        raise RuntimeError(
            "trl.trainer.grpo_trainer.VLLMGeneration not found: this TRL version differs from the one QeRL's vLLM "
            f"integration was written against (TRL {WRITTEN_AGAINST['trl']})."
        )
    original = grpo_trainer.VLLMGeneration
    grpo_trainer.VLLMGeneration = factory
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original
