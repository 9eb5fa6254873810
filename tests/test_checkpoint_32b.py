"""The random 32B NVFP4A16 checkpoint that the 32B memory test and ``benchmarks/e2e_step.py``'s 32B rows run on.

On the GPU (``pytest -m gpu``, its own ``scripts/gpu_suite.py`` part, ``checkpoint_32b``, run before
``real_shape_32b``): written on the GPU exactly as those write it (tensor by tensor, about 20 GiB, under
``$QERL_E2E_WORK``), then checked against the library's conversion plan from the shards' headers, and one layer decoded.
The 32B memory test then finds it and runs only the GRPO step: with the write inside, that part took 9.5 minutes at
aa48af6, past the suite's 8 minutes a part. On CPU the same check runs on a tiny checkpoint, so the checker is tested.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import random_models as rm  # noqa: E402

WORK = os.environ.get("QERL_E2E_WORK", "/tmp/qerl-e2e")
WEIGHT_STD = 0.02  # write_nvfp4_checkpoint's default


def expected_tensors(config) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) of every tensor a compressed-tensors NVFP4A16 save of ``config`` holds,
    from the library's own conversion plan (``random_models._Layout``), not from the writer's output."""
    out: dict[str, tuple[str, list[int]]] = {}
    for unit in rm._Layout(config).units.values():
        for kind, spec in unit:
            if kind == "dense":
                name, shape = spec
                out[name] = ("BF16", list(shape))
                continue
            for name, out_f, in_f in spec:
                out[name + ".weight_packed"] = ("U8", [out_f, in_f // 2])
                out[name + ".weight_scale"] = ("F8_E4M3", [out_f, in_f // 16])
                out[name + ".weight_global_scale"] = ("F32", [1])
    return out


def check_checkpoint(path: str, config, decode: str, device: str) -> None:
    """Every tensor of the plan, in its dtype and shape, nothing else; the library's quantization_config; and
    ``decode`` (a Linear's name) dequantizes to weights of the drawn std (nibble order, scales and global scale)."""
    from safetensors import safe_open

    from qerl_trl.nvfp4.format import dequantize

    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    found: dict[str, tuple[str, list[int]]] = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(os.path.join(path, shard), "pt") as f:
            for k in f.keys():
                assert weight_map.get(k) == shard, (k, shard)
                s = f.get_slice(k)
                found[k] = (s.get_dtype(), list(s.get_shape()))
    want = expected_tensors(config)
    diff = {k: (found.get(k), want.get(k)) for k in set(found) | set(want) if found.get(k) != want.get(k)}
    assert not diff, f"(in the checkpoint, in the plan) differ: {dict(sorted(diff.items())[:8])}"
    with open(os.path.join(path, "config.json")) as f:
        quant = json.load(f)["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["ignore"] == ["lm_head"]
    parts = {}
    for suffix in ("weight_packed", "weight_scale", "weight_global_scale"):
        key = f"{decode}.{suffix}"
        with safe_open(os.path.join(path, weight_map[key]), "pt", device=device) as f:
            parts[suffix] = f.get_tensor(key)
    w = dequantize(parts["weight_packed"], parts["weight_scale"], parts["weight_global_scale"], torch.float32)
    std = w.std().item()
    assert abs(std - WEIGHT_STD) < 0.1 * WEIGHT_STD, std  # swapped nibbles or a wrong scale are far off


def test_the_checker_passes_a_written_checkpoint_and_catches_a_wrong_one(tmp_path):
    tiny = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    config = rm.qwen25_config("qwen2.5-7b", num_hidden_layers=2, **tiny)
    path = rm.write_nvfp4_checkpoint(str(tmp_path / "ckpt"), config, max_shard_bytes=40_000)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))  # several shards, as at 32B
    check_checkpoint(path, config, "model.layers.1.mlp.down_proj", "cpu")
    with pytest.raises(AssertionError, match="layers.2"):  # a checkpoint short of a layer
        check_checkpoint(path, rm.qwen25_config("qwen2.5-7b", num_hidden_layers=3, **tiny),
                         "model.layers.1.mlp.down_proj", "cpu")  # fmt: skip


@pytest.mark.gpu
def test_the_32b_nvfp4_checkpoint_is_written_on_the_gpu_as_the_library_saves_it():
    from benchmarks import e2e_step

    path = e2e_step.checkpoint_paths(WORK, "32b")["nvfp4"]
    os.makedirs(WORK, exist_ok=True)
    if not os.path.exists(os.path.join(path, "config.json")):
        free = shutil.disk_usage(WORK).free / 2**30
        if free < 25:
            pytest.skip(f"needs ~20 GiB of disk for the 32B NVFP4 checkpoint, {free:.0f} GiB free")
    e2e_step.prepare_checkpoints(WORK, "32b", need_bf16=False)  # what the 32B rows run first; kept for them
    config = rm.qwen25_config("qwen2.5-32b")
    check_checkpoint(path, config, f"model.layers.{config.num_hidden_layers - 1}.mlp.down_proj", "cuda")
