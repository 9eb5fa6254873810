"""Issue #54's correctness checks at the real shape: ``QeRLGRPOTrainer`` with vLLM colocate on a random
Qwen3-30B-A3B-shaped NVFP4A16 checkpoint (48 layers, 128 experts, 8 active; 17 GiB, written tensor by tensor as
``benchmarks/e2e_step.py`` writes it, and shared with it under ``$QERL_E2E_WORK``), AQN on, sleep mode level 1, the
default LoRA backend with the LoRA on the attention, vLLM at 30B-A3B's share of ``e2e_step.py`` (0.35), 3 steps.

The checks are the small Qwen3-MoE's (``test_moe_colocate_gpu``, the same job): vLLM serves every layer's experts
in NVFP4, AQN's σ is realized in vLLM's norms, the rollout guard stays quiet, vLLM's log-probs of a fixed completion
match the trainer's after a sync, the LoRA moves and the packed experts do not, and with the noise-free norms synced
vLLM routes a fixed sequence's tokens to the experts the trainer's routers pick: at most 5% of the expert choices
differ, each within a quarter of a logit standard deviation of a tie (the bound is on choices, not whole sets of
8, for this shape: ``test_moe_colocate_gpu``'s docstring says why). The
e2e rows measure the step and the peak at this shape; this part checks that what they time is right.
``gpu_suite.py real_shape_moe`` on the GPU machine (80 GB: about 55 GiB at the peak).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


def test_colocate_training_of_qwen3_30b_a3b(tmp_path):
    pytest.importorskip("vllm")
    from colocate_job import run_job_in_child

    run_job_in_child(__file__, "qerl@30b-a3b", tmp_path)


if __name__ == "__main__":  # the job in a fresh process (see the test)
    from colocate_job import main
    from test_moe_colocate_gpu import _job

    main(_job)
