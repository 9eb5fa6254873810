"""A mixture-of-experts policy in the job users run (issue #54): ``QeRLGRPOTrainer`` with vLLM
colocate on a small Qwen3-MoE-shaped random model (16 experts, 4 active; hidden 1024; 8 layers), AQN on, sleep mode
level 1, 3 steps, under each LoRA backend.

Checks, as ``test_real_shape_colocate`` makes them for a dense model: the loss is finite, the LoRA (on the attention)
moves, the packed experts do not, vLLM serves the experts as NVFP4 (its expert method is named), AQN's σ is realized in
vLLM's norms, the rollout guard stays quiet, and after a sync vLLM's log-probs of a fixed completion match the
trainer's, with the adapter moving them. Then, with the noise-free norms and the adapter synced, vLLM routes a fixed
sequence's tokens to the experts the trainer's routers pick (``qerl_trl.trainer.moe_routing``, vLLM's routing
capture on): every (token, layer) that differs must be a near-tie of the trainer's router logits
(:data:`ROUTING_TIE_GAP` logit standard deviations), and at most 5% of the expert choices may differ
(:data:`ROUTING_SLOTS_MIN`). A wrong expert order or router would route about a quarter of the choices alike (4 of 16
experts), noise left in vLLM's norms would move choices far from ties. The bound is on choices, not on whole
(token, layer) sets: at Qwen3-30B-A3B's 8 of 128 a random router's 8th and 9th logits lie about 0.06 standard
deviations apart (a third of 4 of 16's gap) and any of 8 choices can flip, so the first real-shape run (3b2f6d1,
an H100) had 80% of the sets and 97.4% of the choices alike, every difference within 0.14 deviations of a tie.
``pytest -m vllm`` on the GPU machine (``gpu_suite.py moe``).
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

WORK = os.environ.get("QERL_E2E_WORK", "/tmp/qerl-e2e")
#: small enough to write in seconds, large enough for vLLM's NVFP4 MoE kernels (sizes multiples of 128)
ROUTING_SLOTS_MIN = 0.95  # fraction of the k expert choices (over tokens and layers) both made
ROUTING_TIE_GAP = 0.25  # largest trainer-logit gap (in logit standard deviations) at which the two may differ
SHAPE = dict(hidden_size=1024, intermediate_size=1024, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64)  # fmt: skip


@pytest.mark.parametrize("lora_backend", ["qerl", "vllm", "vllm+experts"])
def test_colocate_training_of_a_qwen3_moe_policy(tmp_path, lora_backend):
    """Each backend in its own process: one colocated engine per process, as in training. ``vllm+experts``: a LoRA
    on every routed expert too (``target_modules`` naming ``"experts"``), served by vLLM's fused-MoE LoRA."""
    pytest.importorskip("vllm")
    from colocate_job import run_job_in_child

    run_job_in_child(__file__, lora_backend, tmp_path)


def _job(case: str, tmp_path) -> None:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from benchmarks import random_models as rm
    from benchmarks.rollout import expert_kernels_of
    from colocate_job import train_and_check
    from qerl_trl import QeRLGRPOConfig, QeRLGRPOTrainer
    from qerl_trl.nvfp4.experts import NVFP4Experts

    import torch

    lora_case, _, real_size = case.partition("@")  # "qerl@30b-a3b": the real shape (test_real_shape_moe_gpu)
    lora_backend, _, on_experts = lora_case.partition("+")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] + (["experts"] if on_experts else [])
    lora = LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=targets)
    if real_size:  # the NVFP4 checkpoint benchmarks/e2e_step.py trains (tensor by tensor, no 16-bit copy), its share
        from benchmarks.e2e_step import SIZES, checkpoint_paths, vllm_memory_utilization

        config = rm.qwen3_moe_config(SIZES[real_size])
        path = rm.write_nvfp4_checkpoint(checkpoint_paths(WORK, real_size)["nvfp4"], SIZES[real_size], device="cuda",
                                         seed=0)  # fmt: skip
        share = vllm_memory_utilization(real_size)
    else:
        config = rm.qwen3_moe_config("qwen3-30b-a3b", **SHAPE)
        path = rm.write_bf16_checkpoint(os.path.join(WORK, "moe-small-bf16"), config, device="cuda", seed=0)
        share = 0.3
    layers = config.num_hidden_layers
    tok = AutoTokenizer.from_pretrained(path)
    args = QeRLGRPOConfig(
        output_dir=str(tmp_path / "out"), report_to="none", max_steps=3, logging_steps=1, save_strategy="no", seed=0,
        bf16=True, gradient_checkpointing=True, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, max_completion_length=96, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=share, vllm_max_model_length=256, vllm_enable_sleep_mode=True, aqn=True,
        aqn_sigma_start=1e-2, aqn_sigma_end=1e-3, aqn_num_stages=3, learning_rate=1e-4, vllm_lora_backend=lora_backend,
        nvfp4_cache_dir=str(tmp_path / "cache"), vllm_return_routed_experts=True,
    )  # fmt: skip

    def reward(completions, **kw):
        return [float(sum(map(ord, c)) % 97) / 97 for c in completions]

    prompts = rm.make_prompts(8, 64, seed=0, tokenizer=tok)
    trainer = QeRLGRPOTrainer(model=path, reward_funcs=reward, args=args, peft_config=lora if on_experts else None,
                              train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)  # fmt: skip
    gen = trainer.vllm_generation
    served = gen.llm.apply_model(expert_kernels_of)[0]
    print(f"engine start {gen.engine_start_seconds:.1f} s, FP4 kernel {gen.serving.fp4_kernel}, experts: {served}")
    assert sum(served.values()) == layers and all("Nvfp4" in k for k in served), served

    # at the real shape the packed experts are 9.7 GB: their starting copy for the frozen check is kept on the CPU
    experts, lora0 = train_and_check(trainer, NVFP4Experts, "gate_up_packed", (1e-2, 1e-3, 3),
                                     frozen_device="cpu" if real_size else None)  # fmt: skip
    assert len(experts) == layers
    if on_experts:  # the experts' LoRA trained too (check_trained: the LoRA moved, vLLM's log-probs follow it)
        moved = [n for n, p in trainer.model.named_parameters() if ".mlp.experts.lora_B" in n
                 and not torch.equal(p.detach(), lora0[n])]  # fmt: skip
        assert moved, "the experts' LoRA did not train"
    else:
        assert lora0 and all("self_attn" in n for n in lora0), "the LoRA is on the attention only"

    # the noise-free norms and the trained adapter are in the engine (the log-prob check synced them)
    import json

    from qerl_trl.trainer.moe_routing import check_routing

    ids = torch.randint(10, tok.vocab_size, (96,), generator=torch.Generator().manual_seed(3)).tolist()
    routing = check_routing(trainer, ids)
    print("routing check:", json.dumps(routing))
    assert routing["layers"] == layers and routing["tokens"] == len(ids), routing
    assert routing["same_slots"] >= ROUTING_SLOTS_MIN and routing["max_tie_gap"] <= ROUTING_TIE_GAP, routing


if __name__ == "__main__":  # one backend's job in a fresh process (see the test)
    from colocate_job import main

    main(_job)
