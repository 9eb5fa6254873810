"""The comparison study behind ``qerl-trl compare``: does an NVFP4 LoRA (with or without AQN) learn as a BF16 one?

- :mod:`.spec`: the shared types (``LearningConfig``, ``RunSpec``, the arms, the per-run records file);
- :mod:`.runner`: trains every (arm, seed, learning rate) in its own process (``run_comparison``);
- :mod:`.report`: per-claim verdicts, paired by seed, and the plot, from the records alone;
- :mod:`.tasks`: offline arithmetic tasks (the demo uses them too);
- :mod:`.scoring`: held-out greedy accuracy on the HF policy.

This package face imports nothing, so ``python -m qerl_trl.study.runner`` (each run's child process) loads only
what it needs.
"""
