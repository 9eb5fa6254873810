"""A Qwen3-MoE policy trains on the CPU (use_vllm=False) with its experts in NVFP4 and the LoRA on the attention, as a
dense one does (no option); another MoE layout is refused before anything loads, naming what trains instead. Its
vLLM colocate path is the GPU suite's ``moe`` part (issue #54)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import random_models as rm
from qerl_trl import QeRLGRPOTrainer
from qerl_trl.nvfp4 import NVFP4Linear
from qerl_trl.nvfp4.experts import NVFP4Experts
from qerl_trl.quantizer.moe import MoENotSupportedError
from tests.test_nvfp4_experts import tiny_moe
from tests.test_trainer_grpo import VOCAB, config, dataset, make_tokenizer, token_sum_reward


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe-bf16")
    model = tiny_moe(dtype=torch.bfloat16)
    model.resize_token_embeddings(VOCAB)
    model.config.eos_token_id = model.config.pad_token_id = model.config.bos_token_id = 2
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


def test_the_old_moe_option_warns_that_it_is_ignored(tmp_path):
    with pytest.warns(FutureWarning, match=r"experimental_moe=\.\.\.\) is deprecated and ignored"):
        args = config(tmp_path, experimental_moe=True)
    assert args.experimental_moe is True  # kept as given, read by nothing


@pytest.mark.slow
def test_a_qwen3_moe_policy_trains_its_attention_lora_over_nvfp4_experts(moe_checkpoint, tmp_path):
    trainer = QeRLGRPOTrainer(model=moe_checkpoint, reward_funcs=token_sum_reward,
                              args=config(tmp_path / "out", max_steps=2, save_strategy="no"),
                              train_dataset=dataset(), processing_class=make_tokenizer())  # fmt: skip
    model = trainer.model
    experts = [m for m in model.modules() if isinstance(m, NVFP4Experts)]
    assert len(experts) == 2 and sum(isinstance(m, NVFP4Linear) for m in model.modules()) == 2 * 4
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "self_attn" in n for n in trainable), trainable[:4]
    packed = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert any(not torch.equal(p.detach(), lora[n]) for n, p in model.named_parameters() if n in lora)
    assert all(torch.equal(p.detach(), packed[n]) for n, p in model.named_parameters() if n in packed)
    assert any("aqn/sigma" in h for h in trainer.state.log_history)
    # the routing check's trainer side reads the trained policy's routers through PEFT and the packed experts
    from qerl_trl.trainer.moe_routing import trainer_routing

    model.eval()
    indices, logits = trainer_routing(model, torch.tensor([5, 9, 11, 3]))
    assert indices.shape == (4, 2, model.config.num_experts_per_tok) and logits.shape[:2] == (4, 2)
    assert torch.equal(indices.sort(-1).values, logits.topk(indices.shape[-1]).indices.sort(-1).values)


def test_only_qwen3_moe_passes_the_architecture_check_among_moe_layouts():
    from qerl_trl.trainer.policy import check_architecture

    qwen3 = rm.qwen3_moe_config("qwen3-30b-a3b", **{"num_hidden_layers": 1})
    assert check_architecture(qwen3) == "Qwen3MoeForCausalLM"
    from transformers import AutoConfig

    mixtral = AutoConfig.for_model("mixtral", num_local_experts=4)
    said = r"\(4 experts, mixtral\)\. QeRL trains Qwen3-MoE.*Mixtral's w1/w2/w3"
    with pytest.raises(MoENotSupportedError, match=said):
        check_architecture(mixtral)


def test_whole_model_humming_on_a_moe_is_refused_before_anything_loads():
    """vLLM 0.24's Humming MoE method cannot load NVFP4A16 experts (the GPU suite's ``moe`` part at 517d8d7): the
    "vllm" backend with vllm_fp4_kernel='humming' is refused from the config, saying what to set instead."""
    from types import SimpleNamespace

    from qerl_trl.trainer.policy import check_vllm_layout

    qwen3 = rm.qwen3_moe_config("qwen3-30b-a3b", **{"num_hidden_layers": 1})

    def args(**kw):
        return SimpleNamespace(**{"use_vllm": True, "vllm_mode": "server", "vllm_lora_backend": "vllm",
                                  "vllm_fp4_kernel": "humming", "vllm_return_routed_experts": False, **kw})  # fmt: skip

    with pytest.raises(ValueError, match=r"Humming MoE method.*vllm_fp4_kernel='auto'.*vllm_lora_backend='qerl'"):
        check_vllm_layout(qwen3, args())
    for ok in (args(vllm_fp4_kernel="auto"), args(vllm_lora_backend="qerl"), args(use_vllm=False)):
        check_vllm_layout(qwen3, ok)


def test_lora_targets_off_the_attention_of_a_moe_are_refused_before_anything_loads(moe_checkpoint, tmp_path,
                                                                                    monkeypatch):  # fmt: skip
    """PEFT would skip an expert name quietly (the experts are not Linears): the user would train less than asked."""
    from peft import LoraConfig

    from qerl_trl.quantizer import hf_quantizer
    from qerl_trl.trainer.policy import check_moe_lora

    qwen3 = rm.qwen3_moe_config("qwen3-30b-a3b", **{"num_hidden_layers": 1})
    for ok in (["q_proj", "v_proj"], "all-linear", r".*self_attn\.(q|v)_proj", ["q_proj", "experts"],
               r".*(self_attn\.q_proj|mlp\.experts)"):  # fmt: skip
        check_moe_lora(qwen3, LoraConfig(target_modules=ok))
    from types import SimpleNamespace

    experts = LoraConfig(target_modules=["q_proj", "experts"])
    for backend, mode, said in (("qerl", "colocate", "vllm_lora_backend='vllm'"), ("vllm", "server", "colocate mode")):
        args = SimpleNamespace(use_vllm=True, vllm_lora_backend=backend, vllm_mode=mode)
        with pytest.raises(ValueError, match=said):  # the expert LoRA is served by vLLM's adapters in colocate mode
            check_moe_lora(qwen3, experts, args)
        check_moe_lora(qwen3, LoraConfig(target_modules=["q_proj"]), args)
    check_moe_lora(qwen3, experts, SimpleNamespace(use_vllm=True, vllm_lora_backend="vllm", vllm_mode="colocate"))
    check_moe_lora(qwen3, experts, SimpleNamespace(use_vllm=False, vllm_lora_backend="qerl", vllm_mode="colocate"))
    dense = rm.qwen25_config("qwen2.5-7b")
    check_moe_lora(dense, LoraConfig(target_modules=["q_proj", "gate_proj"]))  # a dense model: as before
    for bad, said in ((["q_proj", "gate_proj"], r"target_modules \['gate_proj'\]"),
                      (r".*mlp.*", r"matches model.layers.0.mlp.gate"),
                      (None, r"target_parameters=\['mlp.experts.gate_up_proj'\]")):  # fmt: skip
        lora = LoraConfig(target_modules=bad, target_parameters=["mlp.experts.gate_up_proj"] if bad is None else None)
        with pytest.raises(ValueError, match=said):
            check_moe_lora(qwen3, lora)

    def no_load(*a, **kw):
        raise AssertionError("a weight loaded before the refusal")

    monkeypatch.setattr(hf_quantizer.NVFP4HfQuantizer, "__init__", no_load)
    with pytest.raises(ValueError, match="attention projections"):
        QeRLGRPOTrainer(model=moe_checkpoint, reward_funcs=token_sum_reward,
                        args=config(tmp_path), train_dataset=dataset(),
                        processing_class=make_tokenizer(),
                        peft_config=LoraConfig(target_modules=["q_proj", "down_proj"]))  # fmt: skip


@pytest.mark.slow
def test_a_qwen3_moe_policy_trains_a_lora_on_its_experts_without_vllm(moe_checkpoint, tmp_path):
    """Issue #54 item 3: target_modules naming "experts" puts a LoRA on every routed expert (NVFP4ExpertsLora):
    it trains with the attention's, the packed experts stay as they were, and the checkpoint's adapter is per
    expert."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    from qerl_trl.peft_lora import NVFP4ExpertsLora

    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "experts"])
    trainer = QeRLGRPOTrainer(model=moe_checkpoint, reward_funcs=token_sum_reward,
                              args=config(tmp_path / "out", max_steps=2, save_strategy="steps",
                                          save_steps=2),
                              train_dataset=dataset(), processing_class=make_tokenizer(), peft_config=lora)  # fmt: skip
    model = trainer.model
    assert sum(isinstance(m, NVFP4ExpertsLora) for m in model.modules()) == 2
    # AQN noises the norms found once on the base model, the ones vLLM keeps float32: both norms of each layer
    from qerl_trl.aqn import vllm_param_name

    names = [vllm_param_name(t) for t in trainer.aqn.targets]
    assert sorted(names) == sorted(f"model.layers.{i}.{n}.weight" for i in range(2)
                                   for n in ("input_layernorm", "post_attention_layernorm"))  # fmt: skip
    assert list(trainer.aqn.clean_weights(model)) == names  # the PEFT model's noise: the same targets, no new trace
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n}
    trainer.train()
    moved = [n for n, p in model.named_parameters() if "lora_B" in n and ".experts." in n
             and not torch.equal(p.detach(), before[n])]  # fmt: skip
    assert moved, "the experts' LoRA did not train"
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters()
               if "experts" in n and "lora_" not in n)  # fmt: skip
    saved = load_file(tmp_path / "out" / "checkpoint-2" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_B.weight" in saved
