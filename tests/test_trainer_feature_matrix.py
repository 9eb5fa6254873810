"""GRPOConfig's features through QeRLGRPOTrainer on CPU (use_vllm=False), two steps each on a tiny NVFP4 Qwen2.

Each case asserts that the LoRA changed, the packed NVFP4 base did not, and the metrics TRL logs for that feature
are in the log. The cases are ours (not TRL's tests): every loss_type; beta > 0 with the base (adapter disabled)
as reference; num_iterations > 1; weighted reward functions; a sequence-classification reward model; an iterable
dataset; an eval dataset; mask_truncated_completions; top_entropy_quantile < 1; sequence-level importance
sampling; generation kwargs; chat-template kwargs on conversational prompts; tools.

The 19 cases share one tiny checkpoint (module fixture) and take ~20 s together on 2 CPU cores (the slowest,
the eval case, ~1.3 s), so none is marked ``slow`` ("more than a few seconds on CPU").
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

import qerl_trl  # noqa: F401
from qerl_trl import QeRLGRPOTrainer
from tests.conftest import tiny_config, tiny_model
from tests.test_trainer_grpo import config, dataset, lora_state, make_tokenizer, packed_state, token_sum_reward

#: logged by TRL's GRPOTrainer on every training step, whatever the features
TRL_METRICS = (
    "loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "num_tokens", "entropy",
    "completions/mean_length", "completions/clipped_ratio", "completions/mean_terminated_length",
)  # fmt: skip
EOS = 2
#: make EOS likely, so most completions end before max_completion_length (a GenerationConfig field)
EOS_BIAS = {"sequence_bias": [[[EOS], 5.0]]}
#: every loss_type of TRL 1.16, with the loss-specific metric it logs (sapo logs none of its own)
LOSS_TYPES = {
    "grpo": "clip_ratio/region_mean", "dr_grpo": "clip_ratio/region_mean", "dapo": "clip_ratio/region_mean",
    "bnpo": "clip_ratio/region_mean", "luspo": "clip_ratio/region_mean", "cispo": "cispo_clip_ratio",
    "vespo": "vespo/phi_seq_mean", "sapo": None,
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny 16-bit Qwen2 + tokenizer, shared by every case (each trainer quantizes it on load)."""
    path = tmp_path_factory.mktemp("matrix-qwen2")
    model = tiny_model("qwen2")
    model.generation_config.eos_token_id = model.config.eos_token_id = EOS
    model.generation_config.pad_token_id = model.config.pad_token_id = 1
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


def length_reward(completions, **kwargs):
    return [float(len(c.split())) for c in completions]


def chat_token_sum_reward(completions, **kwargs):
    """token_sum_reward for conversational completions (lists of messages)."""
    return token_sum_reward([c[-1]["content"] for c in completions])


def run(checkpoint, tmp_path, reward_funcs=(token_sum_reward,), train_dataset=None, extra=(), trainer_kwargs=None,
        **cfg):
    """Train 2 steps; check the LoRA moved, the packed base did not, and TRL's metrics (+ ``extra``) were logged."""
    args = config(tmp_path, max_steps=2, save_strategy="no", **cfg)
    trainer = QeRLGRPOTrainer(
        model=checkpoint, reward_funcs=list(reward_funcs), args=args,
        train_dataset=train_dataset if train_dataset is not None else dataset(),
        **{"processing_class": make_tokenizer(), **(trainer_kwargs or {})},
    )  # fmt: skip
    lora0, packed0 = lora_state(trainer.model), packed_state(trainer.model)
    trainer.train()
    lora1, packed1 = lora_state(trainer.model), packed_state(trainer.model)
    assert any(not torch.equal(lora0[n], lora1[n]) for n in lora0 if "lora_B" in n), "the LoRA did not change"
    assert packed0 and all(torch.equal(packed0[n], packed1[n]) for n in packed0), "the NVFP4 base changed"
    steps = [h for h in trainer.state.log_history if "loss" in h and "step" in h]
    assert len(steps) == 2
    for name in trainer.reward_func_names:
        assert f"rewards/{name}/mean" in steps[0]
    missing = [k for k in (*TRL_METRICS, *extra) if k not in steps[0]]
    assert not missing, f"not logged: {missing}"
    return trainer, steps


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_loss_type(checkpoint, tmp_path, loss_type):
    run(checkpoint, tmp_path, loss_type=loss_type, extra=(LOSS_TYPES[loss_type],) if LOSS_TYPES[loss_type] else ())


def test_beta_reference_is_the_base_with_the_adapter_disabled(checkpoint, tmp_path):
    trainer, steps = run(checkpoint, tmp_path, beta=0.1, extra=("kl",))
    assert list(trainer.model.peft_config) == ["default"]  # no reference copy: the adapter is disabled instead
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # LoRA B starts at 0: policy == base on step 1
    assert steps[1]["kl"] > 0.0


def test_num_iterations(checkpoint, tmp_path):
    _, steps = run(checkpoint, tmp_path, num_iterations=2, extra=("clip_ratio/region_mean",))
    assert "reward" not in steps[1] and "clip_ratio/region_mean" in steps[1]  # step 2 reuses step 1's rollouts


def test_weighted_reward_functions(checkpoint, tmp_path):
    trainer, steps = run(
        checkpoint, tmp_path, reward_funcs=(token_sum_reward, length_reward), reward_weights=[1.0, 0.5],
    )  # fmt: skip
    s = steps[0]
    want = s["rewards/token_sum_reward/mean"] + 0.5 * s["rewards/length_reward/mean"]
    assert s["reward"] == pytest.approx(want, rel=1e-4)


def test_sequence_classification_reward_model(checkpoint, tmp_path):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_config(tiny_config("qwen2", num_labels=1, pad_token_id=1))
    rm.config._name_or_path = "tiny-reward-model"
    trainer, _ = run(
        checkpoint, tmp_path, reward_funcs=(rm,), trainer_kwargs={"reward_processing_classes": [make_tokenizer()]},
    )  # fmt: skip
    assert trainer.reward_func_names == ["tiny-reward-model"]


def test_iterable_dataset(checkpoint, tmp_path):
    run(checkpoint, tmp_path, train_dataset=dataset().to_iterable_dataset())


def test_eval_dataset(checkpoint, tmp_path):
    trainer, _ = run(
        checkpoint, tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4,
        trainer_kwargs={"eval_dataset": dataset(4)},
    )  # fmt: skip
    evals = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert evals and "eval_completions/mean_length" in evals[0]


def test_generation_kwargs_and_mask_truncated_completions(checkpoint, tmp_path):
    _, steps = run(
        checkpoint, tmp_path, generation_kwargs=EOS_BIAS, mask_truncated_completions=True, max_completion_length=8,
    )  # fmt: skip
    assert all(s["completions/clipped_ratio"] < 1.0 for s in steps)  # the EOS bias reached generate()


def test_top_entropy_quantile(checkpoint, tmp_path):
    run(checkpoint, tmp_path, top_entropy_quantile=0.2)


def test_sequence_level_importance_sampling(checkpoint, tmp_path):
    run(checkpoint, tmp_path, importance_sampling_level="sequence", num_iterations=2)


def test_chat_template_kwargs_on_conversational_prompts(checkpoint, tmp_path, monkeypatch):
    tok_cls = type(make_tokenizer())
    seen = []
    original = tok_cls.apply_chat_template

    def spy(self, conversation, *args, **kwargs):
        seen.append(kwargs.get("qerl_style"))
        return original(self, conversation, *args, **kwargs)

    monkeypatch.setattr(tok_cls, "apply_chat_template", spy)
    prompts = [[{"role": "user", "content": f"w{i} w{i + 3}"}] for i in range(8)]
    run(
        checkpoint, tmp_path, reward_funcs=(chat_token_sum_reward,), chat_template_kwargs={"qerl_style": "terse"},
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )  # fmt: skip
    assert "terse" in seen


TOOL_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<system> {{ m['name'] }} {{ m['content'] }} <eos> "
    "{% elif m.get('tool_calls') %}<assistant> {% for c in m['tool_calls'] %}{{ c['function']['name'] }} "
    "{% for k, v in c['function']['arguments'].items() %}{{ k }} {{ v }} {% endfor %}{% endfor %}<eos> "
    "{% else %}<{{ m['role'] }}> {{ m['content'] }} {% if m['role'] == 'assistant' %}<eos> {% endif %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"
)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def test_tools(checkpoint, tmp_path, monkeypatch):
    """TRL's tool loop inside QeRL's _generate: the tiny model's completions are parsed as a call to `multiply`
    every other time (a random model cannot write one), TRL runs the tool, appends its result and generates on."""
    import trl.trainer.grpo_trainer as grpo

    calls = []

    def parse(tokenizer, ids, prefix=None, tools=None):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if prefix is not None and len(calls) % 2 == 0 and "w" in text:
            calls.append(text)
            call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
            return {"role": "assistant", "content": "", "tool_calls": [call]}
        calls.append(None)
        return {"role": "assistant", "content": text}

    monkeypatch.setattr(grpo, "parse_response", parse)
    tokenizer = make_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.response_template = "unused: parse_response is patched"
    prompts = [[{"role": "user", "content": f"w{i} w{i + 3}"}] for i in range(8)]
    _, steps = run(
        checkpoint, tmp_path, reward_funcs=(chat_token_sum_reward,), max_tool_calling_iterations=1,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        trainer_kwargs={"tools": [multiply], "processing_class": tokenizer},
        extra=("tools/call_frequency", "tools/failure_frequency"),
    )  # fmt: skip
    assert any(s["tools/call_frequency"] > 0 for s in steps) and all(s["tools/failure_frequency"] == 0 for s in steps)
