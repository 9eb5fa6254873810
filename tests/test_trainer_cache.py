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


_RACER = """
import importlib.util, json, os, sys, time

# the module alone (standard library only), not the qerl_trl package: two package imports cost CI 20 s
spec = importlib.util.spec_from_file_location("nvfp4_cache", sys.argv[4])
cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cache)
ensure_cached_checkpoint = cache.ensure_cached_checkpoint

root, start, me = sys.argv[1], float(sys.argv[2]), sys.argv[3]
while time.time() < start:  # both processes leave the line together
    time.sleep(0.001)

def write(tmp):  # a slow multi-file write, as a real checkpoint's shards are
    for i in range(5):
        with open(os.path.join(tmp, f"model-{i}.safetensors"), "w") as f:
            f.write(me * 1000)
        time.sleep(0.1)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump({"writer": me}, f)

path, written = ensure_cached_checkpoint(root, "org/m", "k1", write)
print(json.dumps({"path": path, "written": written}))
"""


def test_two_processes_that_start_at_once_share_the_cache_intact(tmp_path):
    """Two trainers starting together (processes, not threads) both get one complete checkpoint: every shard from
    the same writer, the marker in place, and no temporary directory left behind."""
    import json
    import subprocess
    import sys
    import time

    from qerl_trl.trainer import nvfp4_cache

    start = time.time() + 1
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path), str(start), name, nvfp4_cache.__file__],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in "AB"]  # fmt: skip
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    paths = {r["path"] for r in results}
    assert len(paths) == 1
    final = paths.pop()
    writer = json.load(open(os.path.join(final, "config.json")))["writer"]
    for i in range(5):
        assert open(os.path.join(final, f"model-{i}.safetensors")).read() == writer * 1000
    assert os.path.exists(os.path.join(final, COMPLETE_MARKER))
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(final)]  # no .tmp-* left
    assert [r["written"] for r in results].count(True) >= 1
