"""The qerl-trl command: help texts, quantize (16-bit -> NVFP4A16 checkpoint), train from a recipe, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qerl_trl.cli import build_parser, main


@pytest.mark.parametrize("cmd", ["quantize", "train", "push", "demo"])
def test_help_is_complete(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[cmd]
    for action in sub._actions:  # every option is documented
        assert action.help, f"{cmd}: {action.dest} has no help"
        for opt in action.option_strings:
            assert opt in text


def test_no_command_prints_usage(capsys):
    assert main([]) == 2
    assert "quantize" in capsys.readouterr().out


def test_quantize_writes_nvfp4a16_checkpoint(tmp_path, capsys):
    from safetensors import safe_open
    from test_examples import tiny_checkpoint

    src = tiny_checkpoint(tmp_path / "bf16")
    out = tmp_path / "nvfp4"
    assert main(["quantize", str(src), str(out), "--modules-to-not-convert", "mlp.down_proj"]) == 0
    assert "vllm serve" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight_packed" in keys
    assert "model.layers.0.mlp.down_proj.weight" in keys  # kept 16-bit as asked
    assert not any(k.endswith("q_proj.weight") for k in keys)
    # the result loads packed through the trainer's loader and is pushable
    from qerl_trl.hub import render_base_card

    card = render_base_card(out, "me/tiny", source_model="Org/Tiny")
    assert "base_model_relation: quantized" in str(card)


def test_quantize_summary_reports_layers_left_16bit(tmp_path, capsys):
    """hidden_size 72: 12 of 14 projections cannot be packed; the summary and a warning say so."""
    from conftest import tiny_model
    from test_examples import tiny_tokenizer

    src = tmp_path / "odd"
    tok = tiny_tokenizer()
    tiny_model("qwen2", vocab_size=len(tok), hidden_size=72, intermediate_size=128).save_pretrained(src)
    tok.save_pretrained(src)
    assert main(["quantize", str(src), str(tmp_path / "q")]) == 0
    captured = capsys.readouterr()
    assert "2 of 15 Linear layers in NVFP4; 16-bit: 12 in_features not a multiple of 16 (the NVFP4 block size); " \
        "1 output embedding (lm_head), 16-bit by design." in captured.out
    assert "warning: 12 of 15 Linear layers stay 16-bit: in_features not a multiple of 16" in captured.err


def test_quantize_refuses_non_empty_out_dir(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep me")
    assert main(["quantize", "whatever", str(tmp_path / "out")]) == 1
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "out" / "x").read_text() == "keep me"


def test_quantize_refuses_quantized_input(tmp_path, capsys):
    from test_examples import tiny_checkpoint

    src = tiny_checkpoint(tmp_path / "bf16")
    assert main(["quantize", str(src), str(tmp_path / "q1")]) == 0
    assert main(["quantize", str(tmp_path / "q1"), str(tmp_path / "q2")]) == 1
    assert "already quantized" in capsys.readouterr().err


@pytest.mark.slow
def test_train_from_recipe_with_overrides(tmp_path):
    from test_examples import CPU_ARGS, gsm8k_rows, tiny_checkpoint

    src = tiny_checkpoint(tmp_path / "bf16")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in gsm8k_rows()))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {src}\ndataset_name: {data}\noutput_dir: {tmp_path / 'out'}\n"
        "learning_rate: 1.0e-4\naqn: true\ngradient_checkpointing: false\n"
    )
    assert main(["train", "--config", str(recipe), *CPU_ARGS]) == 0
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").is_file()


def test_train_missing_recipe(capsys):
    assert main(["train", "--config", "/nonexistent.yaml"]) == 1
    assert "not found" in capsys.readouterr().err


def test_push_adapter_needs_base_repo(capsys):
    with pytest.raises(SystemExit):
        main(["push", "adapter", ".", "me/x"])
    assert "--base-repo" in capsys.readouterr().err


def test_console_script_entry_point():
    r = subprocess.run([sys.executable, "-m", "qerl_trl.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "quantize" in r.stdout and "demo" in r.stdout
