"""The training scripts (``qerl_trl.scripts``, run by ``qerl-trl train`` and by ``examples/*.py``) run end to end
offline on a tiny model (use_vllm=False, a few steps); the recipes parse into them."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import tiny_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def tiny_tokenizer():
    """A byte-level tokenizer (256 byte tokens + 3 specials) with a chat template; needs no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return fast


def tiny_checkpoint(path: Path, arch: str = "qwen2") -> Path:
    """A tiny random bf16 causal LM + tokenizer saved to ``path`` (quantized to NVFP4 on load by the trainer)."""
    tok = tiny_tokenizer()
    model = tiny_model(arch, vocab_size=len(tok))
    model.config.eos_token_id, model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def gsm8k_rows(n: int = 8):
    return [{"question": f"Tom has {a} apples and gets {b} more. How many?", "answer": f"{a}+{b}={a + b}\n#### {a + b}"}
            for a, b in zip(range(1, n + 1), range(2, n + 2))]


def load_script(name: str):
    """The packaged training script ``qerl_trl.scripts.<name>``."""
    return importlib.import_module(f"qerl_trl.scripts.{name}")


def load_example(name: str):
    """``examples/<name>.py`` as a module (it is not importable by name)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


CPU_ARGS = [
    "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
    "--max_completion_length", "6", "--use_cpu", "true", "--bf16", "false", "--report_to", "none",
    "--logging_steps", "1", "--save_strategy", "no", "--use_vllm", "false", "--lora_r", "8", "--lora_alpha", "16",
    "--aqn_num_stages", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def _check_run(trainer, out: Path):
    hist = [h for h in trainer.state.log_history if "reward" in h]
    assert trainer.state.global_step == 2 and len(hist) == 2
    assert all(h["loss"] == h["loss"] for h in hist)  # finite, not NaN
    assert "aqn/sigma" in hist[-1]
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_grpo_gsm8k_runs_offline_with_local_jsonl(tmp_path, tiny_dir):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in gsm8k_rows()))
    ex = load_script("grpo_gsm8k")
    out = tmp_path / "out"
    script_args, training_args = ex.make_parser().parse_args_and_config(
        args=["--model_name_or_path", str(tiny_dir), "--dataset_name", str(data), "--output_dir", str(out), *CPU_ARGS]
    )
    assert script_args.reward_funcs == ["gsm8k_accuracy_reward", "format_reward"]
    trainer = ex.main(script_args, training_args)
    _check_run(trainer, out)
    hist = [h for h in trainer.state.log_history if "reward" in h]
    assert "rewards/gsm8k_accuracy_reward/mean" in hist[0] and "rewards/format_reward/mean" in hist[0]


@pytest.mark.slow
def test_dapo_bigmath_runs_offline_with_recipe_and_parquet(tmp_path, tiny_dir):
    from datasets import Dataset

    data = tmp_path / "bigmath.parquet"
    Dataset.from_list([{"prompt": f"Compute {a}*2.", "solution": str(2 * a)} for a in range(8)]).to_parquet(str(data))
    ex = load_script("dapo_bigmath")
    out = tmp_path / "out"
    recipe = ROOT / "examples" / "recipes" / "qwen2.5-3b_bigmath.yaml"
    script_args, training_args = ex.make_parser().parse_args_and_config(
        args=["--config", str(recipe), "--model_name_or_path", str(tiny_dir), "--dataset_name", str(data),
              "--output_dir", str(out), "--gradient_checkpointing", "false", *CPU_ARGS]  # fmt: skip
    )
    # the recipe's DAPO settings survive, the command line overrides the rest
    assert training_args.loss_type == "dapo" and training_args.beta == 0.0 and training_args.epsilon_high == 0.28
    assert training_args.max_steps == 2 and training_args.use_vllm is False
    trainer = ex.main(script_args, training_args)
    _check_run(trainer, out)
    assert "rewards/boxed_accuracy_reward/mean" in trainer.state.log_history[0]


def test_bad_dataset_columns_are_a_clear_error():
    from datasets import Dataset

    ex = load_script("grpo_gsm8k")
    with pytest.raises(ValueError, match="question"):
        ex.make_gsm8k_prompts(Dataset.from_list([{"problem": "x", "answer": "1"}]), "sys")
    ex2 = load_script("dapo_bigmath")
    with pytest.raises(ValueError, match="prompt"):
        ex2.make_bigmath_prompts(Dataset.from_list([{"text": "x"}]), "sys", 100)


def test_unknown_reward_is_a_clear_error():
    from qerl_trl.scripts.inputs import resolve_rewards

    with pytest.raises(ValueError, match="Unknown reward"):
        resolve_rewards(["no_such_reward"])


RECIPES = sorted((EXAMPLES / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipes_parse_into_the_example_configs(recipe):
    import yaml

    raw = yaml.safe_load(recipe.read_text())
    name = "grpo_gsm8k" if "gsm8k" in recipe.stem else "dapo_bigmath"
    ex = load_script(name)
    script_args, training_args = ex.make_parser().parse_args_and_config(
        args=["--config", str(recipe), "--use_cpu", "true", "--bf16", "false"]
    )
    size = recipe.stem.split("_")[0].split("-")[1].upper()
    assert script_args.model_name_or_path == f"Qwen/Qwen2.5-{size}-Instruct"
    assert training_args.learning_rate == raw["learning_rate"] == 1e-5
    assert training_args.aqn and training_args.aqn_sigma_start == 1e-2 and training_args.aqn_sigma_end == 1e-4
    assert training_args.use_vllm and training_args.vllm_mode == "colocate"
    assert training_args.num_generations == raw["per_device_train_batch_size"]
    assert training_args.loss_type == ("grpo" if name == "grpo_gsm8k" else "dapo")


def test_accelerate_configs():
    import yaml

    single = yaml.safe_load((EXAMPLES / "accelerate_configs" / "single_gpu.yaml").read_text())
    multi = yaml.safe_load((EXAMPLES / "accelerate_configs" / "multi_gpu.yaml").read_text())
    assert single["distributed_type"] == "NO" and single["num_processes"] == 1
    assert multi["distributed_type"] == "MULTI_GPU" and multi["mixed_precision"] == "bf16"


@pytest.mark.parametrize("name", ["grpo_gsm8k", "dapo_bigmath"])
def test_examples_launch_the_packaged_scripts(name):
    example = load_example(name)
    assert "accelerate launch --config_file examples/accelerate_configs/single_gpu.yaml" in example.__doc__
    assert f"examples/{name}.py --config examples/recipes/" in example.__doc__
    script = load_script(name)  # the example is the package's script, not a copy
    assert example.main is script.main and example.make_parser is script.make_parser
