"""`QeRLGRPOTrainer`: TRL's `GRPOTrainer` on an NVFP4 base with a BF16 LoRA, AQN, and vLLM rollouts on FP4.

Overrides (TRL 1.16):

* ``__init__``: takes every ``model=`` form TRL does (``model_forms``): loads a model id/path through
  ``NVFP4Config`` (a 16-bit checkpoint is quantized on load, an NVFP4A16 one loads packed), quantizes a 16-bit
  instance in place, keeps a PeftModel's LoRA on its quantized base; refuses what the NVFP4 base cannot run before
  any weight is converted; applies the default LoRA when no ``peft_config`` is given, checks the LoRA can be
  served by vLLM, prepares the NVFP4A16 checkpoint vLLM serves, and lets ``GRPOTrainer.__init__`` build its vLLM
  backend as ``QeRLVLLMGeneration`` (see ``vllm_serving``), so only one engine is built.
* ``_generate``: once per generation round, draws the round's AQN noise, pushes LoRA + noised norms to vLLM
  (or applies the noise to the HF model when generating without vLLM), generates with TRL's code, restores the
  clean norms and logs ``aqn/sigma``, ``aqn/stage``, rollout tokens/s, LoRA sync seconds and peak GPU memory.

Everything else (loss types, rewards, importance-sampling correction, logging, checkpoint/resume) is TRL's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PreTrainedModel
from trl import GRPOTrainer

from ..model_source import check_model_source
from ..nvfp4 import NVFP4Linear
from ..quantizer.moe import refuse_moe_config
from .checkpoint_check import resolve_resume_checkpoint
from .config import QeRLGRPOConfig
from .model_forms import check_peft_model, has_nvfp4, quantize_instance, rewrap_peft_model, split_peft_model
from .nvfp4_cache import checkpoint_key, ensure_cached_checkpoint, is_nvfp4a16_config
from .reward_watch import DegenerateRewardWatch

logger = logging.getLogger(__name__)

__all__ = ["QeRLGRPOTrainer", "SUPPORTED_ARCHITECTURES"]

#: Dense decoder families the NVFP4 quantizer, AQN's structure search and vLLM's LoRA path are tested on.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def check_architecture(config: Any, model_class_name: str | None = None) -> str:
    """Return the architecture name, or raise a clear error naming an unsupported one (a MoE one: the missing
    parts, see ``quantizer.moe``)."""
    archs = list(getattr(config, "architectures", None) or [])
    arch = model_class_name or (archs[0] if archs else type(config).__name__)
    refuse_moe_config(config, arch)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"QeRLGRPOTrainer does not support the architecture {arch!r}. Supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (dense decoder-only models)."
        )
    return arch


def load_device_map(state: Any, requested: Any = None) -> Any:
    """Where the policy loads: straight onto this process's GPU, as QLoRA is loaded under DDP.

    TRL 1.16 loads with ``device_map="auto"`` on one GPU and ``None`` (the CPU, then the Trainer moves it) under
    DDP. On the CPU, a 16-bit checkpoint would be quantized to NVFP4 by the CPU, and the Trainer would move the model
    only after AQN's target trace. So: the process's own device under DDP
    (one whole copy per rank; a map the user set would place it elsewhere), the user's ``device_map`` or the
    process's device otherwise, and the CPU where the process runs on the CPU (``use_cpu``, CPU DDP) or under
    DeepSpeed (refused by the config, kept as TRL does)."""
    if state.distributed_type == "DEEPSPEED" or state.device.type in ("cpu", "mps"):
        return None
    if state.distributed_type == "MULTI_GPU" or requested is None:
        return {"": state.device}
    return requested


def _base_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _nvfp4_fingerprint(model: nn.Module, n_layers: int = 4, n_bytes: int = 4096) -> str:
    """Cheap content hash of a few packed FP4 weights (tells two instances with the same name apart)."""
    h = hashlib.sha256()
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, NVFP4Linear):
            packed = module.weight_packed.detach().reshape(-1)[:n_bytes].cpu()
            h.update(name.encode())
            h.update(str(tuple(module.weight_packed.shape)).encode())
            h.update(packed.numpy().tobytes())
            h.update(module.weight_global_scale.detach().float().cpu().numpy().tobytes())
            count += 1
            if count >= n_layers:
                break
    return h.hexdigest()[:16]


class QeRLGRPOTrainer(GRPOTrainer):
    """Drop-in `GRPOTrainer` for QeRL: NVFP4 base + BF16 LoRA + AQN, vLLM colocate rollouts on the FP4 weights.

    Args: those of [`trl.GRPOTrainer`]; ``model`` is any form TRL takes (see ``model_forms``): a model id/path
    (loaded through ``NVFP4Config``), a 16-bit ``PreTrainedModel`` (quantized to NVFP4 in place), an NVFP4 one
    (e.g. loaded with ``quantization_config=NVFP4Config()``), or a ``PeftModel`` (its LoRA is kept and its base
    quantized); ``args`` a [`QeRLGRPOConfig`]. Passing ``quantization_config`` is an error: the quantization
    options live in the config.
    """

    _tag_names = ["trl", "grpo", "qerl"]
    # State read by the overridden methods, with TRL's behaviour as the default, so a trainer built without
    # __init__ (as TRL's own white-box tests build GRPOTrainer) runs them as GRPOTrainer would.
    aqn = None  #: the AQN callback; None: no noise
    _rollout_guard = None  #: the rollout-policy check; None: off

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs=None,
        args: QeRLGRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        **kwargs,
    ):
        from peft import PeftModel

        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = QeRLGRPOConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-QeRL-GRPO")
        if not isinstance(args, QeRLGRPOConfig):
            raise TypeError(
                f"QeRLGRPOTrainer needs a QeRLGRPOConfig, got {type(args).__name__}. Replace GRPOConfig(...) by "
                "QeRLGRPOConfig(...) (same arguments)."
            )
        if quantization_config is not None:
            raise ValueError(
                "QeRLGRPOTrainer always loads the base through NVFP4Config; do not pass quantization_config. "
                "Set the NVFP4 options (e.g. nvfp4_modules_to_not_convert) on QeRLGRPOConfig."
            )
        if isinstance(model, str):
            check_model_source(model)
        if args.use_vllm:
            from .vllm_serving import require_humming_if_forced, require_vllm

            require_vllm()
            require_humming_if_forced(args.vllm_fp4_kernel)

        source = model if isinstance(model, str) else None
        source_is_nvfp4 = False
        split = None
        if isinstance(model, PeftModel):  # everything is checked before anything is converted
            if peft_config is not None:
                raise ValueError(
                    "You passed a PeftModel and a peft_config; pass one of them (the PeftModel's own LoRA is used)."
                )
            check_architecture(model.get_base_model().config, type(model.get_base_model()).__name__)
            self._check_vllm_layout(model.get_base_model().config, args)
            self._check_lora_early(check_peft_model(model)[1], args)
            split = split_peft_model(model)
            model, peft_config = split.base, split.lora_config
        else:
            peft_config = peft_config if peft_config is not None else args.default_lora_config()
            self._check_lora_early(peft_config, args)
        if isinstance(model, str):
            from transformers.trainer_utils import set_seed

            set_seed(args.seed)
            model, source_is_nvfp4 = self._load_nvfp4_model(model, args)
        else:
            self._check_policy(model, args)
            if not has_nvfp4(model):
                quantize_instance(model, args.nvfp4_modules_to_not_convert)

        if processing_class is None:
            from transformers import AutoProcessor

            processing_class = AutoProcessor.from_pretrained(
                source or model.config._name_or_path,
                revision=(args.model_init_kwargs or {}).get("revision"),
                truncation_side="left",
                padding_side="left",
                trust_remote_code=args.trust_remote_code,
            )

        # AQN (its targets are found on the base model, before PEFT wraps it)
        self.aqn = None
        if args.aqn:
            from ..aqn import AQNCallback, AQNSchedule, find_noise_targets, vllm_param_name

            schedule = AQNSchedule(args.aqn_sigma_start, args.aqn_sigma_end, args.aqn_num_stages)
            self.aqn = AQNCallback(schedule, seed=args.seed, apply_to=args.aqn_apply_to)
            callbacks = [*(callbacks or []), self.aqn]

        swap = None
        if args.use_vllm:
            from .vllm_serving import (
                VLLMServingSpec,
                check_lora_config_for_vllm,
                make_qerl_vllm_generation_class,
                resolve_fp4_kernel,
                swap_trl_vllm_generation,
                vllm_max_lora_rank,
            )

            rank = check_lora_config_for_vllm(peft_config)
            qerl_lora = args.vllm_lora_backend == "qerl"  # any rank: no vLLM LoRA slots to pad to
            max_rank = rank if qerl_lora else vllm_max_lora_rank(rank, args.vllm_max_lora_rank)
            norm_names = []
            if self.aqn is not None:
                norm_names = [vllm_param_name(t) for t in find_noise_targets(model)]
            if args.vllm_mode == "server":  # the server serves its own copy of the checkpoint, with its kernel
                checkpoint, kernel = self._server_checkpoint_hint(source, source_is_nvfp4), "chosen by the server"
            else:
                checkpoint = self._vllm_checkpoint(model, source, source_is_nvfp4, processing_class, args)
                kernel = resolve_fp4_kernel(
                    args.vllm_fp4_kernel, args.vllm_lora_backend, checkpoint, args.vllm_tensor_parallel_size
                ).kernel
            spec = VLLMServingSpec(
                checkpoint=checkpoint,
                tokenizer=checkpoint,
                max_lora_rank=max_rank,
                fp32_norm_names=norm_names,
                enforce_eager=args.vllm_enforce_eager,
                lora_sync_dir=args.vllm_lora_sync_dir,
                lora_backend=args.vllm_lora_backend,
                fp4_kernel=kernel,
            )
            cls = make_qerl_vllm_generation_class()
            swap = swap_trl_vllm_generation(lambda *a, **kw: cls(*a, serving=spec, **kw))

        if split is not None:  # the user's LoRA and tensors back on the NVFP4 base (TRL copies it as "ref" if beta>0)
            model, peft_config = rewrap_peft_model(model, split), None
        if swap is None:
            super().__init__(
                model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                reward_processing_classes, callbacks, optimizers, None, peft_config, **kwargs,
            )  # fmt: skip
        else:
            with swap:
                super().__init__(
                    model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                    reward_processing_classes, callbacks, optimizers, None, peft_config, **kwargs,
                )  # fmt: skip
        from .distributed import exclude_nvfp4_base_from_ddp
        from .rollout_guard import RolloutPolicyGuard

        self._reward_watch = DegenerateRewardWatch()
        self._rollout_guard = (
            RolloutPolicyGuard(args.vllm_max_logprob_gap)
            if args.use_vllm and args.vllm_max_logprob_gap is not None
            else None
        )

        exclude_nvfp4_base_from_ddp(self.model)  # frozen, identical on every rank: DDP must not broadcast it
        if args.use_vllm and not args.vllm_importance_sampling_correction:
            logger.warning(
                "vllm_importance_sampling_correction=False: the FP4+AQN rollout policy differs from the trained "
                "policy; QeRL keeps TRL's importance-sampling correction on."
            )

    # -- model loading ------------------------------------------------------------------------------------------

    @staticmethod
    def _check_lora_early(lora_config, args: QeRLGRPOConfig) -> None:
        """Refuse LoRA settings the NVFP4 base (or vLLM's serving of it) cannot run, before any weight loads."""
        from ..peft_lora import check_lora_config_for_nvfp4

        check_lora_config_for_nvfp4(lora_config)
        targets = lora_config.target_modules
        if isinstance(targets, (list, set, tuple)) and "lm_head" in targets:  # GRPOTrainer refuses it after loading
            raise ValueError(
                "LoRA on lm_head is never trained by GRPO (TRL computes log-probs from lm_head.weight directly): "
                "remove 'lm_head' from target_modules."
            )
        if args.use_vllm:
            from .vllm_serving import check_lora_config_for_vllm

            check_lora_config_for_vllm(lora_config)

    @staticmethod
    def _load_nvfp4_model(model_id: str, args: QeRLGRPOConfig) -> tuple[PreTrainedModel, bool]:
        """Load ``model_id`` with its Linears as NVFP4Linear; return ``(model, checkpoint_is_nvfp4a16)``."""
        from ..quantizer import NVFP4Config, load_nvfp4

        kwargs = dict(args.model_init_kwargs or {})
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        kwargs.setdefault("dtype", torch.bfloat16)
        kwargs["device_map"] = load_device_map(args.distributed_state, kwargs.get("device_map"))
        config = AutoConfig.from_pretrained(
            model_id, revision=kwargs.get("revision"), trust_remote_code=kwargs["trust_remote_code"]
        )
        check_architecture(config)
        QeRLGRPOTrainer._check_vllm_layout(config, args)
        qc = getattr(config, "quantization_config", None)
        qc = qc if isinstance(qc, dict) or qc is None else qc.to_dict()
        is_nvfp4 = is_nvfp4a16_config({"quantization_config": qc})
        if qc is not None and not is_nvfp4:
            raise ValueError(
                f"{model_id} is already quantized ({qc.get('quant_method')}, format {qc.get('format')}); QeRL needs "
                "a 16-bit checkpoint (quantized to NVFP4 on load) or a compressed-tensors NVFP4A16 one."
            )
        if is_nvfp4:  # packed tensors load as they are
            return load_nvfp4(model_id, **kwargs), True
        quant = NVFP4Config(modules_to_not_convert=args.nvfp4_modules_to_not_convert)
        return load_nvfp4(model_id, quantization_config=quant, **kwargs), False

    @staticmethod
    def _check_policy(model: nn.Module, args: QeRLGRPOConfig) -> None:
        base = _base_model(model)
        check_architecture(base.config, type(base).__name__)
        QeRLGRPOTrainer._check_vllm_layout(base.config, args)

    @staticmethod
    def _check_vllm_layout(config: Any, args: QeRLGRPOConfig) -> None:
        """Colocate mode: refuse a ``vllm_tensor_parallel_size`` vLLM cannot shard this model over, or that does not
        divide the number of processes, before any weight loads (vLLM would refuse it only once the engine starts,
        after the trainer has loaded the model). Server mode: the server's own setting."""
        if args.use_vllm and args.vllm_mode == "colocate":
            from .vllm_serving.parallel_rules import check_tensor_parallel_layout

            check_tensor_parallel_layout(config, args.vllm_tensor_parallel_size, args.world_size)

    @staticmethod
    def _server_checkpoint_hint(source: str | None, source_is_nvfp4: bool) -> str:
        """Server mode: what the server must serve (for messages): the NVFP4A16 checkpoint this trainer loaded, or
        the one ``qerl-trl quantize`` writes from its 16-bit model (byte-equal to the base quantized on load)."""
        if source is not None and source_is_nvfp4:
            return source
        logger.warning(
            "vllm_mode='server': the server must serve the NVFP4A16 checkpoint of this model, written by `qerl-trl "
            "quantize %s NVFP4_DIR` (byte-equal to the base this trainer quantized on load); training from that "
            "directory too rules out a mismatch.", source or "MODEL",
        )
        return "NVFP4_DIR"

    @staticmethod
    def _vllm_checkpoint(model, source, source_is_nvfp4, processing_class, args) -> str:
        """The NVFP4A16 checkpoint vLLM serves: the user's own, or one written once into the cache dir."""
        if source is not None and source_is_nvfp4:
            return source
        base = _base_model(model)
        name = source or getattr(base.config, "_name_or_path", "") or type(base).__name__
        qc = getattr(base.config, "quantization_config", None)
        identity = {
            "name": name,
            "revision": (args.model_init_kwargs or {}).get("revision"),
            "commit": getattr(base.config, "_commit_hash", None),
            "fingerprint": _nvfp4_fingerprint(base),
        }
        options = {
            "quantization_config": qc.to_dict() if hasattr(qc, "to_dict") else qc,
            "modules_to_not_convert": args.nvfp4_modules_to_not_convert,
        }
        key = checkpoint_key(identity, options)

        def write(tmp: str) -> None:
            base.save_pretrained(tmp)
            processing_class.save_pretrained(tmp)

        from accelerate import PartialState

        state = PartialState()
        with state.local_main_process_first():
            path, written = ensure_cached_checkpoint(args.resolved_cache_dir, name, key, write)
        with open(os.path.join(path, "config.json")) as f:
            import json

            if not is_nvfp4a16_config(json.load(f)):
                raise RuntimeError(
                    f"The checkpoint written to {path} is not a compressed-tensors NVFP4A16 checkpoint; the model's "
                    "save_pretrained must come from qerl_trl's NVFP4 quantizer."
                )
        logger.info("vLLM serves the NVFP4A16 checkpoint %s (%s)", path, "written now" if written else "cached")
        return path

    # -- generation ---------------------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        """TRL's, then the rollout-policy check (see ``rollout_guard``) on the round's two sets of log-probs."""
        output = super()._generate_and_score_completions(inputs)
        if self._rollout_guard is not None and self.model.training:
            self._check_rollout_policy(output)
        return output

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """TRL's, after checking the checkpoint to resume from (``checkpoint_check``): ``True`` skips a newest
        checkpoint whose save did not finish, and a broken named checkpoint fails here, naming the file and the last
        checkpoint that loads."""
        if resume_from_checkpoint:
            resume_from_checkpoint = resolve_resume_checkpoint(
                resume_from_checkpoint, self.args.output_dir, needs_optimizer=not self.args.save_only_model
            )
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's (every process's rewards, gathered), then a warning if GRPO can learn nothing from them
        (``reward_watch``)."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.model.training and self.accelerator.is_main_process:
            names = [getattr(f, "__name__", None) or type(f).__name__ for f in self.reward_funcs]
            self._reward_watch.check(self.state.global_step, rewards_per_func, self.reward_weights,
                                     self.num_generations, names)  # fmt: skip
        return rewards_per_func

    def _check_rollout_policy(self, output: dict) -> None:
        sampling, trainer = output.get("sampling_per_token_logps"), output.get("old_per_token_logps")
        if sampling is None or trainer is None:  # TRL computes them with vllm_importance_sampling_correction
            return
        guard = self._rollout_guard
        gap, nan_fraction = guard.measure(sampling, trainer, output["completion_mask"])
        local_bad = torch.tensor([float(guard.is_bad(gap, nan_fraction))], device=self.accelerator.device)
        any_bad = bool(self.accelerator.gather(local_bad).max() > 0)  # every rank stops together
        guard.update(self.state.global_step, gap, nan_fraction, bad=any_bad)

    def _generate(self, prompts: list):
        mode = "train" if self.model.training else "eval"
        model = self.model
        rollout_norms = None
        if self.aqn is not None:
            if mode == "train":
                rollout_norms = self.aqn.begin_rollout(model, self.state, hf_generation=not self.use_vllm)
            else:  # evaluation rollouts are noise-free
                self.aqn.restore()
                rollout_norms = self.aqn.clean_weights(model) if self.use_vllm else None
        try:
            if self.use_vllm:
                self.vllm_generation.pending_norms = rollout_norms
                self.vllm_generation.sync_weights()
                self._last_loaded_step = self.state.global_step
                self._metrics[mode]["qerl/lora_sync_seconds"].append(self.vllm_generation.last_sync_seconds)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        finally:
            if self.aqn is not None and mode == "train":
                self.aqn.end_rollout(model)
        completion_ids = out[1]
        n_tokens = sum(len(c) for c in completion_ids)
        self._metrics[mode]["qerl/rollout_tokens_per_s"].append(n_tokens / max(seconds, 1e-9))
        if self.aqn is not None and mode == "train":
            for k, v in self.aqn.metrics(self.state).items():
                self._metrics[mode][k].append(v)
        if torch.cuda.is_available():
            self._metrics[mode]["qerl/peak_gpu_memory_gib"].append(torch.cuda.max_memory_allocated() / 2**30)
        return out
