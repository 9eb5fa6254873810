"""The NVFP4 checkpoint cache: written once, keyed by model + options, atomic."""

from __future__ import annotations

import os

import pytest

from qerl_trl.trainer.nvfp4_cache import (
    COMPLETE_MARKER,
    checkpoint_key,
    ensure_cached_checkpoint,
    is_nvfp4a16_config,
)


def _writer(calls):
    def write(tmp):
        calls.append(tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("{}")

    return write


def test_written_once_then_reused(tmp_path):
    calls = []
    key = checkpoint_key({"name": "m"}, {"ignore": ["lm_head"]})
    path, written = ensure_cached_checkpoint(str(tmp_path), "org/m", key, _writer(calls))
    assert written and len(calls) == 1
    assert os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, COMPLETE_MARKER))
    assert os.path.basename(path) == f"org--m-{key}"
    path2, written2 = ensure_cached_checkpoint(str(tmp_path), "org/m", key, _writer(calls))
    assert path2 == path and not written2 and len(calls) == 1
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no temp dirs left


def test_key_depends_on_identity_and_options():
    k = checkpoint_key({"name": "m", "revision": None}, {"modules_to_not_convert": None})
    assert k == checkpoint_key({"revision": None, "name": "m"}, {"modules_to_not_convert": None})
    assert k != checkpoint_key({"name": "m", "revision": "v2"}, {"modules_to_not_convert": None})
    assert k != checkpoint_key({"name": "m", "revision": None}, {"modules_to_not_convert": ["down_proj"]})


def test_failed_write_leaves_nothing(tmp_path):
    def bad(tmp):
        with open(os.path.join(tmp, "partial.safetensors"), "w") as f:
            f.write("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ensure_cached_checkpoint(str(tmp_path), "m", "abc", bad)
    assert os.listdir(tmp_path) == []
    calls = []
    path, written = ensure_cached_checkpoint(str(tmp_path), "m", "abc", _writer(calls))
    assert written
    assert set(os.listdir(path)) == {"config.json", COMPLETE_MARKER}


def test_stale_partial_dir_is_replaced(tmp_path):
    stale = tmp_path / "m-abc"
    stale.mkdir()
    (stale / "half.safetensors").write_text("x")
    path, written = ensure_cached_checkpoint(str(tmp_path), "m", "abc", _writer([]))
    assert written and set(os.listdir(path)) == {"config.json", COMPLETE_MARKER}


def test_is_nvfp4a16_config():
    assert is_nvfp4a16_config({"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}})
    assert is_nvfp4a16_config(
        {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "mixed",
                "config_groups": {"group_0": {"format": "nvfp4-pack-quantized"}},
            }
        }
    )
    assert not is_nvfp4a16_config({"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized"}})
    assert not is_nvfp4a16_config({"quantization_config": {"quant_method": "bitsandbytes"}})
    assert not is_nvfp4a16_config({})
