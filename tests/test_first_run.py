"""What a new user meets first (issue #56): a dataset too small for one step is refused before the model loads, the
model card TRL writes names and cites QeRL, and our NVFP4 quantizer lives beside transformers' own."""

from __future__ import annotations

import types

import pytest
from datasets import Dataset, IterableDataset

from qerl_trl import QeRLGRPOConfig, QeRLGRPOTrainer
from qerl_trl.trainer.dataset_check import check_train_dataset, prompts_per_generation
from tests.test_trainer_grpo import config, dataset, make_tokenizer, token_sum_reward


def test_a_dataset_too_small_for_one_step_is_refused_before_the_model_loads(tmp_path):
    args = config(tmp_path, per_device_train_batch_size=8, num_generations=2, gradient_accumulation_steps=2)
    assert prompts_per_generation(args) == 8  # 8 completions x 2 micro-batches / 2 generations per prompt
    with pytest.raises(ValueError, match=r"train_dataset has 5 prompts, fewer than the 8 one training step needs"):
        # a path that does not exist: the dataset is checked before the model is even looked for
        QeRLGRPOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=token_sum_reward, args=args,
                        train_dataset=dataset(5))  # fmt: skip
    with pytest.raises(ValueError, match=r"has 0 prompts, fewer than the 8"):
        check_train_dataset(Dataset.from_dict({"prompt": []}), args)
    check_train_dataset(dataset(8), args)  # exactly one generation round: TRL's sampler yields it


def test_datasets_of_unknown_length_and_none_are_left_to_trl():
    args = types.SimpleNamespace(generation_batch_size=64, num_generations=8)
    check_train_dataset(None, args)
    check_train_dataset(IterableDataset.from_generator(lambda: iter([{"prompt": "a"}])), args)


def test_the_model_card_names_qerl_and_cites_its_paper(tmp_path):
    trainer = QeRLGRPOTrainer(model=_tiny_checkpoint(tmp_path), reward_funcs=token_sum_reward,
                              args=config(tmp_path / "out", max_steps=1), train_dataset=dataset(),
                              processing_class=make_tokenizer())  # fmt: skip
    trainer.create_model_card(model_name="qerl-tiny")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "trained with QeRL, a method introduced in" in card
    assert "https://huggingface.co/papers/2510.11696" in card and "huang2025qerl" in card
    assert "shao2024deepseekmath" in card  # GRPO, the algorithm QeRL trains with, is still cited
    assert card.index("huang2025qerl") < card.index("shao2024deepseekmath")


def _tiny_checkpoint(tmp_path) -> str:
    from tests.conftest import tiny_model

    path = tmp_path / "tiny"
    tiny_model("qwen2").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


def test_our_quantizer_and_transformers_own_nvfp4_each_keep_their_name():
    """transformers ships its own ``NVFP4Config`` (quant_method "nvfp4", on-the-fly W4A4 through Hub kernels); ours
    registers "qerl_nvfp4". Importing both leaves each reachable under its own name."""
    import transformers
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
        AutoQuantizationConfig,
    )

    import qerl_trl
    from qerl_trl.quantizer import QUANT_METHOD, NVFP4HfQuantizer

    assert QUANT_METHOD == "qerl_nvfp4"
    assert AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] is qerl_trl.NVFP4Config
    assert AUTO_QUANTIZER_MAPPING[QUANT_METHOD] is NVFP4HfQuantizer
    assert isinstance(AutoQuantizationConfig.from_dict({"quant_method": QUANT_METHOD}), qerl_trl.NVFP4Config)
    if "nvfp4" in AUTO_QUANTIZATION_CONFIG_MAPPING:  # transformers' own, where this version ships it
        theirs = AUTO_QUANTIZATION_CONFIG_MAPPING["nvfp4"]
        assert theirs is not qerl_trl.NVFP4Config and theirs.__module__.startswith("transformers.")
        assert AUTO_QUANTIZER_MAPPING["nvfp4"].__module__.startswith("transformers.")
        assert getattr(transformers, "NVFP4Config", theirs) is theirs
