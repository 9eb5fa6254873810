"""Every form of ``model=`` TRL's GRPOTrainer accepts, through QeRLGRPOTrainer (CPU, use_vllm=False):
a 16-bit instance (quantized in place, one group at a time), a PeftModel (its LoRA kept), an NVFP4 instance;
options refused before any model loads; a trainer built without ``__init__``; MoE refused with the missing parts."""

from __future__ import annotations

import gc
import math
from collections import defaultdict

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from torch import nn
from trl import GRPOTrainer

import qerl_trl  # noqa: F401
from qerl_trl import NVFP4Config, QeRLGRPOConfig, QeRLGRPOTrainer
from qerl_trl.nvfp4 import NVFP4Linear
from qerl_trl.quantizer import conversion, load_nvfp4
from qerl_trl.quantizer.moe import MoENotSupportedError
from tests.conftest import tiny_config, tiny_model
from tests.test_trainer_grpo import VOCAB, config, dataset, lora_state, make_tokenizer, packed_state, token_sum_reward

N_FP4 = 2 * 7  # a 2-layer tiny decoder: q, k, v, o, gate, up, down per layer


def trainer_for(model, tmp_path, peft_config=None, **cfg):
    cfg = {"max_steps": 2, "save_strategy": "no", **cfg}
    return QeRLGRPOTrainer(
        model=model, reward_funcs=token_sum_reward, args=config(tmp_path, **cfg), train_dataset=dataset(),
        processing_class=make_tokenizer(), peft_config=peft_config,
    )  # fmt: skip


def train_and_check(trainer):
    """Train; the LoRA changed, the packed base did not, and TRL logged its loss and reward."""
    lora0, packed0 = lora_state(trainer.model), packed_state(trainer.model)
    assert len(packed0) == 3 * N_FP4
    trainer.train()
    lora1, packed1 = lora_state(trainer.model), packed_state(trainer.model)
    assert any(not torch.equal(lora0[n], lora1[n]) for n in lora0 if "lora_B" in n)
    assert all(torch.equal(packed0[n], packed1[n]) for n in packed0)
    logged = trainer.state.log_history[0]
    assert "loss" in logged and "reward" in logged


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_16bit_instance_is_quantized_in_place_and_trains(tmp_path, dtype):
    model = tiny_model("qwen2", dtype=dtype)
    trainer = trainer_for(model, tmp_path)
    assert trainer.model.get_base_model() is model  # the caller's object, converted in place
    fp4 = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    assert len(fp4) == N_FP4 and all(m.compute_dtype == dtype for m in fp4)
    assert model.config.quantization_config["format"] == "nvfp4-pack-quantized"
    train_and_check(trainer)


def test_nvfp4_instance_is_used_as_is(tmp_path):
    path = tmp_path / "bf16"
    tiny_model("qwen2").save_pretrained(path)
    model = load_nvfp4(path, quantization_config=NVFP4Config(), dtype=torch.bfloat16)
    packed = {n: m.weight_packed for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    trainer = trainer_for(model, tmp_path / "o")
    wrapped = {n: trainer.model.get_base_model().get_submodule(n).get_base_layer() for n in packed}
    assert all(wrapped[n].weight_packed is t for n, t in packed.items())  # the same tensors: nothing requantized


def test_16bit_instance_quantization_peak_is_model_plus_one_layer(monkeypatch):
    """Quantizing a user's instance frees each 16-bit weight as its packed copy is made: the heap never rises
    by more than one layer, and ends lower by the 16-bit Linear weights less their packed copies. A copy of the
    model would rise by all of it (checked with the same probe)."""
    import copy

    from test_quantizer_memory import PeakSampler, _mallinfo, _nbytes

    from qerl_trl.trainer.model_forms import quantize_instance

    used = _mallinfo()
    model = tiny_model(
        "llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2,
    )  # fmt: skip
    full_16bit = _nbytes(model.parameters())
    layer_16bit = _nbytes(model.model.layers[0].parameters())
    linear_16bit = _nbytes(m.weight for m in model.model.layers.modules() if isinstance(m, nn.Linear))
    monkeypatch.setattr(conversion, "CHUNK_ELEMENTS", 1 << 16)  # float32 temporaries far below one layer
    sampler = PeakSampler(used)
    orig = conversion.quantize_group

    def sampled(weights):
        sampler.sample()
        out = orig(weights)
        sampler.sample()  # the group's packed copies and its 16-bit weights are both alive here
        return out

    monkeypatch.setattr(conversion, "quantize_group", sampled)
    with sampler:
        quantize_instance(model, None)
    gc.collect()
    freed = sampler.base - used()
    print(
        f"\n16-bit model {full_16bit / 2**20:.1f} MiB, one layer {layer_16bit / 2**20:.1f} MiB, peak rise "
        f"{sampler.rise / 2**20:.2f} MiB, freed {freed / 2**20:.1f} MiB of {linear_16bit / 2**20:.1f} MiB of 16-bit "
        "Linears"
    )
    assert sum(isinstance(m, NVFP4Linear) for m in model.modules()) == 8 * 7
    assert sampler.rise <= layer_16bit + 2 * 2**20, (sampler.rise, layer_16bit)
    packed = _nbytes(p for m in model.modules() if isinstance(m, NVFP4Linear) for p in m.parameters())
    assert freed >= linear_16bit - packed - 2 * 2**20, (freed, linear_16bit, packed)  # the 16-bit weights are gone

    with PeakSampler(used) as whole:  # the probe sees a copy of the (now packed) model
        clone = copy.deepcopy(model)
    assert whole.rise >= 0.9 * _nbytes(clone.parameters())


def test_peft_model_keeps_the_users_lora(tmp_path):
    base = tiny_model("qwen2")
    user = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.05, task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, user)
    torch.manual_seed(1)
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:  # a trained adapter, not a fresh one
            p.data.normal_(0, 0.02)
    adapter = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}

    trainer = trainer_for(peft_model, tmp_path, beta=0.04)
    cfg = trainer.model.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, set(cfg.target_modules), cfg.lora_dropout) == (4, 8, {"q_proj", "v_proj"}, 0.05)
    assert not cfg.inference_mode
    mine = {n: p for n, p in trainer.model.named_parameters() if ".default." in n and "lora_" in n}
    assert mine.keys() == adapter.keys()
    # the user's tensors (PEFT kept them fp32 on the bf16 base; on NVFP4 they are BF16, QeRL's setting)
    assert all(mine[n].dtype == torch.bfloat16 and torch.equal(mine[n], adapter[n].to(torch.bfloat16)) for n in adapter)
    assert sum(isinstance(m, NVFP4Linear) for m in trainer.model.modules()) == N_FP4
    assert "ref" in trainer.model.peft_config  # beta > 0: TRL's frozen copy of the user's adapter is the reference
    train_and_check(trainer)


def test_peft_model_on_an_nvfp4_base(tmp_path):
    path = tmp_path / "bf16"
    tiny_model("qwen2").save_pretrained(path)
    base = load_nvfp4(path, quantization_config=NVFP4Config(), dtype=torch.bfloat16)
    trainer = trainer_for(get_peft_model(base, LoraConfig(r=4, target_modules="all-linear")), tmp_path / "o")
    assert trainer.model.peft_config["default"].r == 4
    train_and_check(trainer)


@pytest.mark.parametrize(
    "lora, match",
    [
        (LoraConfig(r=4, use_dora=True, target_modules=["q_proj"]), "plain LoRA only; use_dora"),
        (LoraConfig(r=4, init_lora_weights="pissa", target_modules=["q_proj"]), "pissa.*dense base weight"),
        (LoraConfig(r=4, lora_bias=True, target_modules=["q_proj"]), "lora_bias=True"),
        (LoraConfig(r=4, target_modules=["q_proj", "lm_head"]), "remove 'lm_head' from target_modules"),
    ],
)
def test_refused_peft_options_fail_before_the_model_is_converted(tmp_path, lora, match):
    peft_model = get_peft_model(tiny_model("qwen2"), lora)
    with pytest.raises(ValueError, match=match):
        trainer_for(peft_model, tmp_path)
    assert not any(isinstance(m, NVFP4Linear) for m in peft_model.modules())  # untouched, adapter still on
    assert "default" in peft_model.peft_config
    plain = tiny_model("qwen2")
    with pytest.raises(ValueError, match="target_parameters"):
        trainer_for(plain, tmp_path, peft_config=LoraConfig(r=4, target_parameters=["mlp.gate_proj.weight"]))
    assert not any(isinstance(m, NVFP4Linear) for m in plain.modules())


def test_peft_model_with_two_adapters_or_a_second_config_is_refused(tmp_path):
    peft_model = get_peft_model(tiny_model("qwen2"), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="pass one of them"):
        trainer_for(peft_model, tmp_path, peft_config=LoraConfig(r=8))
    peft_model.add_adapter("other", LoraConfig(r=4, target_modules=["v_proj"]))
    with pytest.raises(ValueError, match=r"2 adapters \(\['default', 'other'\]\); QeRL trains one"):
        trainer_for(peft_model, tmp_path)
    assert not any(isinstance(m, NVFP4Linear) for m in peft_model.modules())


def test_options_an_always_on_lora_cannot_run_fail_in_the_config(tmp_path):
    with pytest.raises(ValueError, match="sync_ref_model=True cannot run in QeRL.*set sync_ref_model=False"):
        QeRLGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, beta=0.04, sync_ref_model=True)
    with pytest.raises(ValueError, match=r"model_init_kwargs\['quantization_config'\] is not used"):
        QeRLGRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, model_init_kwargs={"quantization_config": {}}
        )


def test_a_trainer_built_without_init_runs_the_overrides_like_trl(monkeypatch):
    """TRL's white-box tests build GRPOTrainer with __new__ and set only what they use: our overrides must not
    read state that only our __init__ sets."""
    out = {"completion_mask": torch.ones(1, 2), "prompt_ids": torch.zeros(1, 1)}
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", lambda self, inputs: out)
    monkeypatch.setattr(GRPOTrainer, "_generate", lambda self, prompts: ([[1]], [[5, 6, 7]], None, None))
    trainer = QeRLGRPOTrainer.__new__(QeRLGRPOTrainer)
    trainer.model = nn.Linear(2, 2)
    trainer.use_vllm = False
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    assert trainer._generate_and_score_completions([{"prompt": "w1"}]) is out
    assert trainer._generate(["w1"]) == ([[1]], [[5, 6, 7]], None, None)
    assert trainer._metrics["train"]["qerl/rollout_tokens_per_s"][0] > 0
    assert "aqn/sigma" not in trainer._metrics["train"]


def _moe_config(kind: str):
    from transformers import AutoConfig

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    if kind == "qwen3_moe":
        return AutoConfig.for_model(
            "qwen3_moe", **common, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, head_dim=16, architectures=["Qwen3MoeForCausalLM"],
        )  # fmt: skip
    return AutoConfig.for_model(
        "mixtral", **common, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        architectures=["MixtralForCausalLM"],
    )  # fmt: skip


@pytest.mark.parametrize("form", ["instance", "path"])
def test_a_qwen3_moe_drops_in_with_its_experts_in_nvfp4(tmp_path, form):
    """The drop-in forms on a mixture-of-experts policy (issue #54): no option; the experts packed, the LoRA on the
    attention, two steps trained with the packed experts unchanged."""
    from transformers import AutoModelForCausalLM

    from qerl_trl.nvfp4.experts import NVFP4Experts

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_moe_config("qwen3_moe"))
    model.resize_token_embeddings(VOCAB)
    model.config.eos_token_id = model.config.pad_token_id = model.config.bos_token_id = 2
    if form == "path":
        model.save_pretrained(tmp_path / "moe")
        make_tokenizer().save_pretrained(tmp_path / "moe")
        model = str(tmp_path / "moe")
    trainer = trainer_for(model, tmp_path / "out")
    experts = [m for m in trainer.model.modules() if isinstance(m, NVFP4Experts)]
    assert len(experts) == 1 and sum(isinstance(m, NVFP4Linear) for m in trainer.model.modules()) == 4
    packed = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "experts" in n}
    trainer.train()
    assert all(torch.equal(p.detach(), packed[n]) for n, p in trainer.model.named_parameters() if n in packed)
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def test_another_moe_layout_is_refused_before_weights_load_naming_what_trains(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, PreTrainedModel

    cfg = _moe_config("mixtral")
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path / "mixtral")
    make_tokenizer().save_pretrained(tmp_path / "mixtral")
    said = r"\(4 experts, mixtral\)\. QeRL trains Qwen3-MoE policies.*Mixtral's w1/w2/w3.*dense model"
    with pytest.raises(MoENotSupportedError, match=said):  # the instance form: before any conversion
        trainer_for(model, tmp_path / "o1")
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())

    def no_load(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(no_load))
    with pytest.raises(MoENotSupportedError, match=said):  # the path form: from the config alone
        trainer_for(str(tmp_path / "mixtral"), tmp_path / "o2")


def test_vllm_checkpoint_from_an_instance_quantized_in_place(tmp_path):
    """The checkpoint vLLM would serve for an instance quantized in place is NVFP4A16 with the same tensors."""
    from qerl_trl.trainer.model_forms import quantize_instance
    from qerl_trl.trainer.policy import vllm_checkpoint

    model = tiny_model("qwen2")
    quantize_instance(model, None)  # what the trainer does to an instance before PEFT wraps it
    args = config(tmp_path, nvfp4_cache_dir=str(tmp_path / "cache"))
    path = vllm_checkpoint(model, None, False, make_tokenizer(), args)
    served = load_nvfp4(path, dtype=torch.bfloat16)
    for name, m in model.named_modules():
        if isinstance(m, NVFP4Linear):
            assert torch.equal(served.get_submodule(name).weight_packed, m.weight_packed), name


def test_tiny_config_is_dense():
    from qerl_trl.quantizer.moe import moe_expert_count

    assert moe_expert_count(tiny_config("qwen3")) == 0 and moe_expert_count(_moe_config("mixtral")) == 4


def digit_count_reward(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c[-1]["content"])) for c in completions]


@pytest.mark.gpu
@pytest.mark.vllm
def test_peft_model_on_a_16bit_instance_trains_with_vllm_colocate(smollm2_checkpoints, tmp_path):
    """GPU: a user's PeftModel on a 16-bit SmolLM2 instance -> base quantized in place, the NVFP4A16 checkpoint
    written for vLLM from it, the user's LoRA served by vLLM and trained; vLLM's and the trainer's log-probs agree.
    Run: pytest -m "gpu and vllm" tests/test_trainer_dropin.py -k vllm_colocate"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bf16_dir, _ = smollm2_checkpoints
    base = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16, device_map="cuda")
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    args = QeRLGRPOConfig(
        output_dir=str(tmp_path / "out"), report_to="none", max_steps=3, logging_steps=1, save_strategy="no",
        per_device_train_batch_size=8, num_generations=4, max_completion_length=32, learning_rate=1e-4,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_max_model_length=512,
        nvfp4_cache_dir=str(tmp_path / "cache"), seed=0, aqn=False,  # no noise: the log-prob gap is the serving's
    )  # fmt: skip
    prompts = [[{"role": "user", "content": f"What is {a} + {a + 7}?"}] for a in range(16)]
    trainer = QeRLGRPOTrainer(
        model=get_peft_model(base, lora), reward_funcs=digit_count_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=AutoTokenizer.from_pretrained(bf16_dir),
    )  # fmt: skip
    assert trainer.model.peft_config["default"].r == 16
    assert sum(isinstance(m, NVFP4Linear) for m in trainer.model.modules()) > 0
    lora0, packed0 = lora_state(trainer.model), packed_state(trainer.model)
    trainer.train()
    lora1, packed1 = lora_state(trainer.model), packed_state(trainer.model)
    assert any(not torch.equal(lora0[n], lora1[n]) for n in lora0 if "lora_B" in n)
    assert all(torch.equal(packed0[n], packed1[n]) for n in packed0)
    gaps = [h["sampling/sampling_logp_difference/mean"] for h in trainer.state.log_history
            if "sampling/sampling_logp_difference/mean" in h]  # fmt: skip
    print("vLLM vs trainer log-prob gap per step:", gaps)
    assert gaps and max(gaps) < 0.3  # healthy runs measure ~0.05 (QeRLGRPOConfig.vllm_max_logprob_gap's doc)
