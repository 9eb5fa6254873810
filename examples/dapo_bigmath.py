# Copyright 2025 qerl-trl developers. Licensed under the Apache License, Version 2.0.
"""DAPO on BigMath with QeRL: NVFP4 base + BF16 LoRA + Adaptive Quantization Noise.

The script lives in the package (:mod:`qerl_trl.scripts.dapo_bigmath`, what ``qerl-trl train`` runs);
this file is its entry point for ``accelerate launch``. One GPU:

    accelerate launch --config_file examples/accelerate_configs/single_gpu.yaml \\
        examples/dapo_bigmath.py --config examples/recipes/qwen2.5-7b_bigmath.yaml

Several GPUs on one host (DDP; each rank runs its own colocated vLLM engine):

    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml --num_processes 8 \\
        examples/dapo_bigmath.py --config examples/recipes/qwen2.5-32b_bigmath.yaml

Any option of the recipe can be overridden on the command line (``--learning_rate 2e-5``); ``--help`` lists them.
To change the data or the rewards, copy :mod:`qerl_trl.scripts.dapo_bigmath` (about 100 lines: TRL's GRPO
script with ``QeRLGRPOConfig``/``QeRLGRPOTrainer`` in place of ``GRPOConfig``/``GRPOTrainer``).
"""

from qerl_trl.scripts.dapo_bigmath import main, make_parser

if __name__ == "__main__":
    script_args, training_args = make_parser().parse_args_and_config()
    main(script_args, training_args)
