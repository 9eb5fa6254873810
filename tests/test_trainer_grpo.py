"""QeRLGRPOTrainer end to end on CPU (use_vllm=False): NVFP4 base + LoRA + AQN through TRL's GRPO loop."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset

import qerl_trl  # noqa: F401  (registers NVFP4Config and the PEFT LoRA layer)
from qerl_trl import QeRLGRPOConfig, QeRLGRPOTrainer
from qerl_trl.aqn import AQNSchedule
from qerl_trl.nvfp4 import NVFP4Linear
from tests.conftest import tiny_model

VOCAB = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def make_tokenizer():
    """A 256-token word-level tokenizer built offline (no Hub), matching the tiny model's vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<eos>", "<user>", "<assistant>", "<system>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(VOCAB - len(specials)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>", padding_side="left"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def token_sum_reward(completions, **kwargs):
    """Varies across completions of a random model, so GRPO advantages (and LoRA gradients) are non-zero."""
    return [float(sum(int(w[1:]) for w in c.split() if w[1:].isdigit()) % 7) for c in completions]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_model("qwen2", dtype=torch.bfloat16, tie_word_embeddings=False).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


def dataset(n=8):
    return Dataset.from_dict({"prompt": [f"w{i} w{i + 3} w{2 * i + 1}" for i in range(n)]})


def config(out, **kw):
    base = dict(
        output_dir=str(out),
        bf16=False,
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=4,
        logging_steps=1,
        save_steps=2,
        save_strategy="steps",
        learning_rate=5e-3,
        gradient_checkpointing=False,
        lora_r=8,
        lora_alpha=16,
        aqn_num_stages=4,
        aqn_sigma_start=1e-2,
        aqn_sigma_end=1e-3,
        seed=0,
        dataloader_num_workers=0,
    )
    base.update(kw)
    return QeRLGRPOConfig(**base)


def packed_state(model):
    return {
        n: t.detach().clone()
        for n, t in {**dict(model.named_buffers()), **dict(model.named_parameters())}.items()
        if n.endswith(("weight_packed", "weight_scale", "weight_global_scale"))
    }


def lora_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def aqn_log(history):
    return {h["step"]: (h["aqn/sigma"], h["aqn/stage"]) for h in history if "aqn/sigma" in h}


@pytest.mark.slow
def test_grpo_cpu_end_to_end_and_resume(tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    trainer = QeRLGRPOTrainer(
        model=tiny_checkpoint,
        reward_funcs=token_sum_reward,
        args=config(out),
        train_dataset=dataset(),
        processing_class=make_tokenizer(),
    )
    model = trainer.model
    n_fp4 = sum(isinstance(m, NVFP4Linear) for m in model.modules())
    assert n_fp4 == 2 * 7, "every projection is NVFP4"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    packed0 = packed_state(model)
    assert len(packed0) == 3 * n_fp4
    lora0 = lora_state(model)
    norms0 = {n: p.detach().clone() for n, p in model.named_parameters() if "layernorm" in n}

    trainer.train()

    hist = trainer.state.log_history
    losses = [h["loss"] for h in hist if "loss" in h]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    lora1 = lora_state(model)
    changed = [n for n in lora0 if not torch.equal(lora0[n], lora1[n])]
    assert any("lora_B" in n for n in changed), "LoRA B weights were updated"
    packed1 = packed_state(model)
    assert packed1.keys() == packed0.keys()
    for n in packed0:
        assert torch.equal(packed0[n], packed1[n]), f"base tensor {n} changed"
    for n, p in model.named_parameters():  # AQN restored the clean norms after each round
        if n in norms0:
            assert torch.equal(p.detach(), norms0[n]), n

    sched = AQNSchedule(1e-2, 1e-3, 4)
    logged = aqn_log(hist)
    assert sorted(logged) == [1, 2, 3, 4]
    for step, (sigma, stage) in logged.items():
        # the round for optimizer step `step` is generated at global_step = step - 1
        assert sigma == pytest.approx(sched.sigma(step - 1, 4)) and stage == sched.stage(step - 1, 4)
    assert logged[1][0] == 0.0 and logged[4][0] > 0.0  # stage 0 is noise-free, later stages are noisy
    assert all(h.get("qerl/rollout_tokens_per_s", 1) > 0 for h in hist if "loss" in h)
    assert any("qerl/rollout_tokens_per_s" in h for h in hist)

    # Resume from the step-2 checkpoint: the step count and the AQN schedule continue where they stopped.
    resumed = QeRLGRPOTrainer(
        model=tiny_checkpoint,
        reward_funcs=token_sum_reward,
        args=config(tmp_path / "resumed"),
        train_dataset=dataset(),
        processing_class=make_tokenizer(),
    )
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.state.global_step == 4
    relog = aqn_log(resumed.state.log_history)  # steps 1-2 come from the checkpoint, 3-4 from the resumed run
    assert sorted(relog) == [1, 2, 3, 4]
    for step in (3, 4):
        assert relog[step] == pytest.approx(logged[step])
    new_entries = [h for h in resumed.state.log_history if "loss" in h and h["step"] > 2]
    assert [h["step"] for h in new_entries] == [3, 4]
    # the resumed LoRA started from checkpoint-2's adapter, not from a fresh init
    assert not torch.equal(lora_state(resumed.model)[changed[0]], lora0[changed[0]])


def test_errors_for_bad_inputs(tiny_checkpoint, tmp_path):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="QeRLGRPOConfig"):
        QeRLGRPOTrainer(
            model=tiny_checkpoint,
            reward_funcs=token_sum_reward,
            args=GRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none"),
            train_dataset=dataset(),
        )
    with pytest.raises(ValueError, match="do not pass quantization_config"):
        QeRLGRPOTrainer(
            model=tiny_checkpoint,
            reward_funcs=token_sum_reward,
            args=config(tmp_path),
            train_dataset=dataset(),
            quantization_config=qerl_trl.NVFP4Config(),
        )


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB)).save_pretrained(path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        QeRLGRPOTrainer(
            model=str(path),
            reward_funcs=token_sum_reward,
            args=config(tmp_path / "o"),
            train_dataset=dataset(),
            processing_class=make_tokenizer(),
        )


def test_use_vllm_without_vllm_says_how_to_install(tiny_checkpoint, tmp_path):
    try:
        import vllm  # noqa: F401

        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r'pip install "qerl-trl\[vllm\]"'):
        QeRLGRPOTrainer(
            model=tiny_checkpoint,
            reward_funcs=token_sum_reward,
            args=config(tmp_path, use_vllm=True, vllm_mode="colocate"),
            train_dataset=dataset(),
        )


def test_config_defaults_and_validation(tmp_path):
    c = QeRLGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none")
    assert c.learning_rate == 1e-5 and c.lora_r == 32 and c.lora_target_modules == "all-linear"
    assert (c.aqn_sigma_start, c.aqn_sigma_end, c.aqn_num_stages) == (1e-2, 5e-4, 10)
    lora = c.default_lora_config()
    assert lora.r == 32 and lora.target_modules == "all-linear" and lora.bias == "none"
    with pytest.raises(ValueError, match="aqn_apply_to"):
        QeRLGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, aqn_apply_to="policy")
    server = QeRLGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, use_vllm=True, vllm_mode="server")
    assert server.vllm_mode == "server"  # served by `qerl-trl vllm-serve` (tests/test_server_mode.py)


def test_fsdp_and_deepspeed_are_refused_before_anything_is_set_up(tmp_path, monkeypatch):
    """Issue #39's verdict: sharding the packed FP4 base is refused, naming DDP (and TP or server rollouts)."""
    with pytest.raises(ValueError, match=r"under FSDP.*--multi_gpu.*vllm_tensor_parallel_size"):
        QeRLGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, fsdp="full_shard")
    # `accelerate launch --use_deepspeed` says so through the environment; DeepSpeed is not installed here, and the
    # refusal comes before TrainingArguments would import it
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="under DeepSpeed"):
        QeRLGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True)


def test_a_reward_that_is_always_nan_is_warned_about_and_training_goes_on(tiny_checkpoint, tmp_path, caplog):
    """Issue #40: a reward function returning NaN for every completion used to train on silently with loss 0."""
    import logging

    def broken_reward(completions, **kwargs):
        return [math.nan] * len(completions)

    trainer = QeRLGRPOTrainer(
        model=tiny_checkpoint,
        reward_funcs=broken_reward,
        args=config(tmp_path / "run", max_steps=2, save_strategy="no", aqn=False),
        train_dataset=dataset(),
        processing_class=make_tokenizer(),
    )
    with caplog.at_level(logging.WARNING, logger="qerl_trl.trainer.reward_watch"):
        trainer.train()
    assert trainer.state.global_step == 2  # it warns, it does not stop
    warned = [r.getMessage() for r in caplog.records if r.name == "qerl_trl.trainer.reward_watch"]
    assert len(warned) == 1  # once, then at most every REPEAT_EVERY steps
    assert warned[0].startswith("QeRL: step 0: every reward is NaN (4 completions; reward functions ['broken_reward'])")


def test_the_policy_loads_onto_the_processs_own_gpu():
    """Straight onto the process's GPU (one whole copy per DDP rank, as QLoRA is loaded), not onto the CPU first:
    there a 16-bit checkpoint would be quantized by the CPU. The CPU where the process runs there."""
    from types import SimpleNamespace

    from qerl_trl.trainer.policy import load_device_map

    def state(kind, device):
        return SimpleNamespace(distributed_type=kind, device=torch.device(device))

    assert load_device_map(state("NO", "cuda:0")) == {"": torch.device("cuda:0")}
    assert load_device_map(state("NO", "cuda:0"), "auto") == "auto"  # the user's own map, on one process
    assert load_device_map(state("MULTI_GPU", "cuda:1")) == {"": torch.device("cuda:1")}
    assert load_device_map(state("MULTI_GPU", "cuda:1"), "auto") == {"": torch.device("cuda:1")}  # not spread
    assert load_device_map(state("NO", "cpu")) is None
    assert load_device_map(state("MULTI_CPU", "cpu")) is None
    assert load_device_map(state("DEEPSPEED", "cuda:0")) is None
