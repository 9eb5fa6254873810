"""`QeRLGRPOTrainer`: TRL's `GRPOTrainer` on an NVFP4 base with a BF16 LoRA, AQN, and vLLM rollouts on FP4.

Overrides (TRL 1.16):

* ``__init__``: refuses a dataset too small for one step (``dataset_check``), then brings the policy in through
  ``policy.prepare_policy`` (every ``model=`` form TRL takes, checked before any weight is converted, loaded or
  quantized to NVFP4, with the LoRA to train), sets up AQN, writes or finds the NVFP4A16 checkpoint vLLM serves,
  and lets ``GRPOTrainer.__init__`` build its vLLM backend as ``QeRLVLLMGeneration`` (see ``vllm_serving``), so
  only one engine is built.
* ``_generate``: once per generation round, draws the round's AQN noise, pushes LoRA + noised norms to vLLM
  (or applies the noise to the HF model when generating without vLLM), generates with TRL's code, restores the
  clean norms and logs ``aqn/sigma``, ``aqn/stage``, rollout tokens/s, LoRA sync seconds and peak GPU memory.
* ``_generate_and_score_completions``: TRL's, then the rollout-policy check (``rollout_guard``); with
  ``fused_importance_sampling``, without TRL's extra forward for the importance-sampling ratio, which
  ``_compute_loss`` / ``_get_per_token_logps_and_entropies`` then build from the training forward
  (``fused_importance``, written against TRL 1.16.0).

Everything else (loss types, rewards, importance-sampling correction, logging, checkpoint/resume) is TRL's.
"""

from __future__ import annotations

import logging
import textwrap
import time

import torch
from transformers import PreTrainedModel
from trl import GRPOTrainer

from .checkpoint_check import resolve_resume_checkpoint
from .config import QeRLGRPOConfig, humming_compile_ahead_enabled
from .dataset_check import check_train_dataset
from .fused_importance import (
    fused_importance_enabled,
    fused_importance_problem,
    importance_sampling_metrics,
    importance_sampling_ratio,
)
from .policy import prepare_policy, server_checkpoint_hint, vllm_checkpoint
from .reward_watch import DegenerateRewardWatch
from .rollout_guard import RoundGap

logger = logging.getLogger(__name__)

__all__ = ["QeRLGRPOTrainer"]

#: the method TRL's model card names and cites (``BaseTrainer.create_model_card``): QeRL, then GRPO's paper
QERL_PAPER = {
    "title": "QeRL: Beyond Efficiency -- Quantization-enhanced Reinforcement Learning for LLMs",
    "id": "2510.11696",
    # docstyle-ignore
    "citation": textwrap.dedent("""\
        @article{huang2025qerl,
            title        = {{QeRL: Beyond Efficiency -- Quantization-enhanced Reinforcement Learning for LLMs}},
            author       = {Wei Huang and Yi Ge and Shuai Yang and Yicheng Xiao and Huizi Mao and Yujun Lin and
                            Hanrong Ye and Sifei Liu and Ka Chun Cheung and Hongxu Yin and Yao Lu and Xiaojuan Qi and
                            Song Han and Yukang Chen},
            year         = 2025,
            eprint       = {arXiv:2510.11696},
        }"""),
}


class QeRLGRPOTrainer(GRPOTrainer):
    """Drop-in `GRPOTrainer` for QeRL: NVFP4 base + BF16 LoRA + AQN, vLLM colocate rollouts on the FP4 weights.

    Args: those of [`trl.GRPOTrainer`]; ``model`` is any form TRL takes (see ``model_forms``): a model id/path
    (loaded through ``NVFP4Config``), a 16-bit ``PreTrainedModel`` (quantized to NVFP4 in place), an NVFP4 one
    (e.g. loaded with ``quantization_config=NVFP4Config()``), or a ``PeftModel`` (its LoRA is kept and its base
    quantized); ``args`` a [`QeRLGRPOConfig`]. Passing ``quantization_config`` is an error: the quantization
    options live in the config.
    """

    _tag_names = ["trl", "grpo", "qerl"]
    _name = "QeRL"
    _paper = {**QERL_PAPER, "citation": QERL_PAPER["citation"] + "\n\n" + GRPOTrainer._paper["citation"]}
    # State read by the overridden methods, with TRL's behaviour as the default, so a trainer built without
    # __init__ (as TRL's own white-box tests build GRPOTrainer) runs them as GRPOTrainer would.
    aqn = None  #: the AQN callback; None: no noise
    _rollout_guard = None  #: the rollout-policy check; None: off
    _fused_is = False  #: fused_importance_sampling
    _fused_inputs = None  #: the micro-batch whose training forward is running (fused ratio)
    _round_gap: RoundGap | None = None  #: the guard's measure of the round being trained (fused ratio)

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
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = QeRLGRPOConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-QeRL-GRPO")
        if not isinstance(args, QeRLGRPOConfig):
            raise TypeError(
                f"QeRLGRPOTrainer needs a QeRLGRPOConfig, got {type(args).__name__}. Replace GRPOConfig(...) by "
                "QeRLGRPOConfig(...) (same arguments)."
            )
        check_train_dataset(train_dataset, args)
        policy = prepare_policy(model, args, peft_config, processing_class, quantization_config)
        model, processing_class = policy.base, policy.processing_class

        # AQN: its targets are found once, on the base model before PEFT wraps it (PEFT leaves the norms as they are),
        # and the vLLM engine keeps exactly those norms float32
        self.aqn = None
        if args.aqn:
            from ..aqn import AQNCallback, AQNSchedule, find_noise_targets, vllm_param_name

            schedule = AQNSchedule(args.aqn_sigma_start, args.aqn_sigma_end, args.aqn_num_stages)
            self.aqn = AQNCallback(schedule, seed=args.seed, apply_to=args.aqn_apply_to,
                                   targets=find_noise_targets(model))  # fmt: skip
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

            rank = check_lora_config_for_vllm(policy.lora_config)
            qerl_lora = args.vllm_lora_backend == "qerl"  # any rank: no vLLM LoRA slots to pad to
            max_rank = rank if qerl_lora else vllm_max_lora_rank(rank, args.vllm_max_lora_rank)
            norm_names = [] if self.aqn is None else [vllm_param_name(t) for t in self.aqn.targets]
            if args.vllm_mode == "server":  # the server serves its own copy of the checkpoint, with its kernel
                checkpoint = server_checkpoint_hint(policy.source, policy.source_is_nvfp4)
                kernel = "chosen by the server"
            else:
                checkpoint = vllm_checkpoint(model, policy.source, policy.source_is_nvfp4, processing_class, args)
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
                lora_sync_in_place=args.vllm_lora_sync_in_place,
                lora_backend=args.vllm_lora_backend,
                fp4_kernel=kernel,
                humming_ahead=humming_compile_ahead_enabled(args),
                expand_in_gemm=args.vllm_lora_expand_in_gemm,
                return_routed_experts=args.vllm_return_routed_experts,
            )
            cls = make_qerl_vllm_generation_class()
            swap = swap_trl_vllm_generation(lambda *a, **kw: cls(*a, serving=spec, **kw))

        # a PeftModel's LoRA and tensors back on the NVFP4 base (TRL copies it as "ref" if beta > 0)
        model, peft_config = policy.trainer_model()
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

        self._fused_is = fused_importance_enabled(args)  # True was refused by the config where it cannot run
        if args.fused_importance_sampling is None:
            logger.info("fused_importance_sampling=None: %s", "the fused pass" if self._fused_is else
                        f"TRL's separate forward ({fused_importance_problem(args)})")  # fmt: skip
        exclude_nvfp4_base_from_ddp(self.model)  # frozen, identical on every rank: DDP must not broadcast it
        if args.use_vllm and not args.vllm_importance_sampling_correction:
            logger.warning(
                "vllm_importance_sampling_correction=False: the FP4+AQN rollout policy differs from the trained "
                "policy; QeRL keeps TRL's importance-sampling correction on."
            )

    # -- model loading ------------------------------------------------------------------------------------------

    # -- generation ---------------------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        """TRL's, then the rollout-policy check (see ``rollout_guard``) on the round's two sets of log-probs.

        With ``fused_importance_sampling``, TRL's, with its importance-sampling correction switched off for the call
        so that it skips the separate forward for the trainer's log-probs (``_compute_loss`` builds the ratio from
        the training forward); the previous round is judged by the guard first, now that it is whole."""
        if not self._fused_is:
            output = super()._generate_and_score_completions(inputs)
            if self._rollout_guard is not None and self.model.training:
                self._check_rollout_policy(output)
            return output
        training = self.model.training
        if training:
            self._judge_fused_round()
        self.vllm_importance_sampling_correction = False
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self.vllm_importance_sampling_correction = True
        if training and self._rollout_guard is not None:
            self._round_gap = RoundGap(step=self.state.global_step)
        return output

    def _compute_loss(self, model, inputs):
        """TRL's; with ``fused_importance_sampling``, the micro-batch's importance-sampling ratio is built from its
        own training forward's log-probs (in ``_get_per_token_logps_and_entropies``) before TRL's loss reads it."""
        if not self._fused_is or inputs.get("sampling_per_token_logps") is None:
            return super()._compute_loss(model, inputs)
        self._fused_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._fused_inputs = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        inputs, self._fused_inputs = self._fused_inputs, None  # only the first call of a fused _compute_loss
        if inputs is not None:
            self._fuse_importance_ratio(inputs, out[0].detach())
        return out

    def _fuse_importance_ratio(self, inputs: dict, trainer_logps: torch.Tensor) -> None:
        """``inputs["importance_sampling_ratio"]`` from the training forward's log-probs, TRL's ``sampling/*``
        metrics for the micro-batch, and the round's guard measure."""
        from trl.trainer.utils import nanmax, nanmin

        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        sampling = inputs["sampling_per_token_logps"]
        mode = self.vllm_importance_sampling_mode
        ratio = importance_sampling_ratio(trainer_logps, sampling, mask, mode, self.vllm_importance_sampling_clip_min,
                                          self.vllm_importance_sampling_clip_max)  # fmt: skip
        inputs["importance_sampling_ratio"] = ratio
        split = "train" if self.model.training else "eval"
        metrics = importance_sampling_metrics(trainer_logps, sampling, mask, ratio, mode)
        # one gather and one host sync for the five values; the ranks' values reduced as TRL reduces each
        ranks = self.accelerator.gather(torch.stack(list(metrics.values())).float()).reshape(-1, len(metrics))
        for name, column in zip(metrics, ranks.T):
            how = name.rsplit("/", 1)[1]
            if "difference" in name:  # TRL: plain mean / max of the ranks' values
                value = column.mean() if how == "mean" else column.max()
            else:
                value = {"min": nanmin, "max": nanmax, "mean": torch.nanmean}[how](column)
            metrics[name] = value
        for name, value in zip(metrics, torch.stack(list(metrics.values())).tolist()):
            self._metrics[split][name].append(value)
        if self.model.training and self._round_gap is not None:
            self._round_gap.add(sampling, trainer_logps, mask)

    def _judge_fused_round(self) -> None:
        """The rollout guard's verdict on the last round trained with the fused ratio (summed over its
        micro-batches)."""
        gap, self._round_gap = self._round_gap, None
        if gap is not None and self._rollout_guard is not None:
            self._judge_round(gap.step, *gap.result())

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """TRL's, after checking the checkpoint to resume from (``checkpoint_check``): ``True`` skips a newest
        checkpoint whose save did not finish, and a broken named checkpoint fails here, naming the file and the last
        checkpoint that loads. With ``fused_importance_sampling``, the rollout guard then judges the last round, which
        no next round's start judges (every rank calls it: the verdict is gathered)."""
        if resume_from_checkpoint:
            resume_from_checkpoint = resolve_resume_checkpoint(
                resume_from_checkpoint, self.args.output_dir, needs_optimizer=not self.args.save_only_model
            )
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        self._judge_fused_round()
        return output

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
        gap, nan_fraction = self._rollout_guard.measure(sampling, trainer, output["completion_mask"])
        self._judge_round(self.state.global_step, gap, nan_fraction)

    def _judge_round(self, step: int, gap: float, nan_fraction: float) -> None:
        """Record one round with the guard; every rank stops together if any rank's round was bad."""
        guard = self._rollout_guard
        local_bad = torch.tensor([float(guard.is_bad(gap, nan_fraction))], device=self.accelerator.device)
        any_bad = bool(self.accelerator.gather(local_bad).max() > 0)  # every rank stops together
        guard.update(step, gap, nan_fraction, bad=any_bad)

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
