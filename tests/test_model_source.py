"""A ``model`` string that names no model directory fails before any Hub lookup, naming the path and what was
expected; ``qerl-trl quantize`` killed halfway leaves no directory a later run would take for a checkpoint (issue
#40)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_examples import tiny_checkpoint

from qerl_trl import QeRLGRPOConfig, QeRLGRPOTrainer
from qerl_trl.model_source import check_model_source

REPO = Path(__file__).resolve().parent.parent


def args(tmp_path):
    return QeRLGRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", bf16=False, use_cpu=True)


@pytest.mark.parametrize("name", ["/path/that/does/not/exist", "./missing-model", "~/no/such/model", "a/b/c"])
def test_a_missing_local_path_is_named_before_any_hub_lookup(tmp_path, name, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("the Hub was asked"))
    with pytest.raises(FileNotFoundError, match=rf"model='{name}': no such directory .*Expected a local model "
                       r"directory with config.json, or a Hub repo id"):  # fmt: skip
        QeRLGRPOTrainer(model=name, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                        args=args(tmp_path))  # fmt: skip


def test_a_file_is_refused_with_what_to_pass(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"model='.*model.safetensors' is a file; pass the directory that holds the "
                       r"model's config.json"):  # fmt: skip
        QeRLGRPOTrainer(model=str(f), reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                        args=args(tmp_path))  # fmt: skip


def test_directories_without_config_json(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"is a directory without config.json, so it is not a model checkpoint; pass"):
        check_model_source(str(empty))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"it holds a LoRA adapter: pass its base model"):
        check_model_source(str(adapter))


def test_a_gguf_directory_needs_no_config_json(tmp_path):
    """``qerl-trl quantize DIR OUT --gguf-file F``: DIR holds the GGUF file and no config.json."""
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    (gguf_dir / "model.Q4_1.gguf").write_bytes(b"GGUF")
    check_model_source(str(gguf_dir), needs_config=False)
    with pytest.raises(ValueError, match="directory without config.json"):
        check_model_source(str(gguf_dir))


def test_quantize_takes_a_gguf_directory(tmp_path, monkeypatch):
    from qerl_trl.quantizer import checkpoint_conversion

    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    (gguf_dir / "model.Q4_1.gguf").write_bytes(b"GGUF")
    src = tiny_checkpoint(tmp_path / "src")  # what dequantizing the GGUF gives
    monkeypatch.setattr(checkpoint_conversion, "gguf_to_16bit", lambda model, gguf_file, tmp: str(src))
    out = checkpoint_conversion.quantize_checkpoint(str(gguf_dir), tmp_path / "out", gguf_file="model.Q4_1.gguf")
    assert (out / "config.json").exists()


def test_hub_ids_and_model_directories_pass(tmp_path):
    for hub_id in ("gpt2", "Qwen/Qwen2.5-7B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        check_model_source(hub_id)  # left to the Hub
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    check_model_source(str(model))
    check_model_source(os.path.relpath(model))


def test_quantize_refuses_a_missing_source_before_loading(tmp_path):
    from qerl_trl.quantizer import quantize_checkpoint

    with pytest.raises(FileNotFoundError, match=r"model='/no/such/16bit/model': no such directory"):
        quantize_checkpoint("/no/such/16bit/model", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_quantize_killed_halfway_leaves_no_checkpoint_and_the_next_run_cleans_up(tmp_path):
    """A process that dies while the checkpoint is being written (here: right after the weights, before the
    tokenizer) leaves no OUT_DIR; the next run removes its half-written directory and writes a complete one."""
    src = tiny_checkpoint(tmp_path / "src")
    out = tmp_path / "nvfp4"
    killer = textwrap.dedent(f"""
        import os, transformers
        from qerl_trl.quantizer import quantize_checkpoint
        real = transformers.PreTrainedTokenizerBase.save_pretrained
        def die(self, *a, **k):
            os._exit(9)  # killed halfway: weights written, tokenizer not
        transformers.PreTrainedTokenizerBase.save_pretrained = die
        quantize_checkpoint({str(src)!r}, {str(out)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", killer], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert not out.exists()
    partials = list(tmp_path.glob(".nvfp4.partial-*"))
    assert len(partials) == 1 and (partials[0] / "config.json").exists()  # it was killed mid-write indeed

    from qerl_trl.quantizer import load_nvfp4, quantize_checkpoint

    assert quantize_checkpoint(str(src), out) == out
    assert not list(tmp_path.glob(".nvfp4.partial-*"))
    assert (out / "config.json").exists() and (out / "tokenizer_config.json").exists()
    load_nvfp4(str(out))
