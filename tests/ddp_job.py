"""A short QeRL GRPO job that records, per rank, what must agree across data-parallel ranks.

Run under ``accelerate launch`` (``benchmarks._child.accelerate_launch``: the examples' DDP config); each rank appends
JSON lines to ``OUT/rank<R>.jsonl``:

the events of ``benchmarks.multi_gpu.attach_rank_recorder`` (AQN noise, LoRA and, with vLLM, the log-prob gap
of each round), in server mode those of ``attach_server_recorder`` (each sync, the base checksums before and after),
then ``{"event": "done", "global_step", "max_steps"}``.

Used by ``tests/test_ddp.py`` (CPU, gloo), ``tests/test_multi_gpu.py`` (2 GPUs, NCCL, vLLM colocate) and
``tests/test_server_mode_gpu.py`` (one process against a ``qerl-trl vllm-serve`` server).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for benchmarks/


def varied_reward(completions, **kwargs) -> list[float]:
    """A reward that differs between completions of a random model, so GRPO's advantages (and the LoRA) move."""
    return [(sum(map(ord, c)) % 7) / 6 for c in completions]


def job_overrides(text: str | None, config_cls: type) -> dict:
    """``QERL_JOB_CONFIG``, a JSON object of ``QeRLGRPOConfig`` fields set over the job's own: the GPU suite's
    multi-GPU and server parts can then run an option that is off by default (``fused_importance_sampling``, say)
    before its default changes (``gpu_suite.py`` writes the variable into the part's row). Bad text stops the job
    before any weight loads."""
    if not text:
        return {}
    example = '{"fused_importance_sampling": true}'
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"QERL_JOB_CONFIG is not JSON ({e}): give an object of config fields, e.g. {example}")
    if not isinstance(overrides, dict):
        raise SystemExit(f"QERL_JOB_CONFIG must be a JSON object of config fields, e.g. {example}; got {text!r}")
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(config_cls)})
    if unknown:
        raise SystemExit(f"QERL_JOB_CONFIG names no {config_cls.__name__} field: {', '.join(unknown)}")
    return overrides


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max_steps", type=int, default=4)
    p.add_argument("--save_steps", type=int, default=2)
    p.add_argument("--resume", default=None)
    p.add_argument("--use_vllm", action="store_true")
    p.add_argument("--vllm_tensor_parallel_size", type=int, default=1)
    p.add_argument("--vllm_lora_backend", default="qerl", choices=["qerl", "vllm"])
    p.add_argument("--vllm_fp4_kernel", default="auto", choices=["auto", "humming", "marlin"])
    p.add_argument("--vllm_mode", default="colocate", choices=["colocate", "server"])
    p.add_argument("--server_url", default=None, help="vllm_mode=server: the `qerl-trl vllm-serve` server")
    p.add_argument("--lora_r", type=int, default=8)
    p.add_argument("--cache_dir", default=None)
    p.add_argument("--cache_only", action="store_true", help="only prepare vLLM's NVFP4 checkpoint in --cache_dir")
    a = p.parse_args()

    import torch

    from benchmarks.multi_gpu import attach_rank_recorder, attach_server_recorder
    from qerl_trl import QeRLGRPOConfig, QeRLGRPOTrainer
    from qerl_trl.study.tasks import TASKS

    cuda = torch.cuda.is_available() and a.use_vllm
    overrides = job_overrides(os.environ.get("QERL_JOB_CONFIG"), QeRLGRPOConfig)
    settings = dict(
        output_dir=os.path.join(a.out, "trainer"),
        max_steps=a.max_steps,
        save_strategy="steps",
        save_steps=a.save_steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        lora_r=a.lora_r,
        lora_alpha=2 * a.lora_r,
        aqn=True,
        aqn_num_stages=2,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        use_cpu=not cuda,
        bf16=cuda,
        use_vllm=a.use_vllm,
        vllm_mode=a.vllm_mode,
        vllm_server_base_url=a.server_url,
        vllm_server_timeout=600,
        vllm_gpu_memory_utilization=0.3,
        vllm_tensor_parallel_size=a.vllm_tensor_parallel_size,
        vllm_lora_backend=a.vllm_lora_backend,
        vllm_fp4_kernel=a.vllm_fp4_kernel,
        nvfp4_cache_dir=a.cache_dir,
    )
    args = QeRLGRPOConfig(**{**settings, **overrides})
    if a.cache_only:  # both ranks start on an empty cache: the checkpoint must be written once, not raced
        from accelerate import PartialState
        from transformers import AutoTokenizer

        from qerl_trl.trainer import policy
        from qerl_trl.trainer.policy import load_nvfp4_model, vllm_checkpoint

        rank = PartialState().process_index
        calls = []
        ensure = policy.ensure_cached_checkpoint

        def recorded_ensure(*args_, **kwargs):
            calls.append(ensure(*args_, **kwargs))
            return calls[-1]

        policy.ensure_cached_checkpoint = recorded_ensure
        model, _ = load_nvfp4_model(a.model, args)
        tokenizer = AutoTokenizer.from_pretrained(a.model)
        path = vllm_checkpoint(model, a.model, False, tokenizer, args)
        with open(os.path.join(a.out, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"event": "cache", "path": path, "written": calls[-1][1]}) + "\n")
        return
    trainer = QeRLGRPOTrainer(
        model=a.model, reward_funcs=varied_reward, args=args, train_dataset=TASKS["add_small"].dataset(64, seed=0)
    )
    rank = trainer.accelerator.process_index
    path = os.path.join(a.out, f"rank{rank}.jsonl")

    def write(**row) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    attach_rank_recorder(trainer, write)
    if a.vllm_mode == "server" and trainer.accelerator.is_main_process:
        attach_server_recorder(trainer, write)
    trainer.train(resume_from_checkpoint=a.resume)
    if a.vllm_mode == "server" and trainer.accelerator.is_main_process:
        write(event="base", when="after", checksums=trainer.vllm_generation.server_sync.base_checksums())
    write(event="done", global_step=int(trainer.state.global_step), max_steps=int(trainer.state.max_steps))


if __name__ == "__main__":
    main()
    # Leave without exit-time teardown. Under CPU contention gloo's threads sometimes die in the interpreter's (or
    # destroy_process_group's) destructors with "terminate called without an active exception" (SIGABRT), failing a
    # run whose records were all written: 2 of 6 runs with exit-time teardown, and it recurred in CI after an
    # explicit destroy_process_group. A barrier first, so no rank leaves while another is still in a collective.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
