"""compat.py: the HfQuantizer hooks of the running transformers version are the ones transformers calls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from packaging.version import Version

import qerl_trl  # noqa: F401
import transformers
from conftest import tiny_model
from qerl_trl.quantizer import NVFP4Config, NVFP4HfQuantizer, compat
from transformers import AutoModelForCausalLM


def test_compat_version_flag():
    assert compat.PARALLEL_PLAN_API == (Version(transformers.__version__) >= Version("5.21"))


def test_compat_parallel_plan_hook_is_called_by_this_transformers(tmp_path, monkeypatch):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    calls = []
    hook = "update_parallel_plan" if compat.PARALLEL_PLAN_API else "update_tp_plan"
    orig = getattr(compat.HfQuantizerCompat, hook)

    def spy(self, *args):
        calls.append(hook)
        return orig(self, *args)

    monkeypatch.setattr(compat.HfQuantizerCompat, hook, spy)
    AutoModelForCausalLM.from_pretrained(tmp_path / "m", quantization_config=NVFP4Config(), dtype=torch.bfloat16)
    assert calls, f"transformers {transformers.__version__} did not call {hook}"


@pytest.mark.parametrize("dc", [SimpleNamespace(tp_size=2), SimpleNamespace(enable_expert_parallel=True)])
def test_compat_refuses_tensor_and_expert_parallel(dc):
    q = NVFP4HfQuantizer(NVFP4Config(), pre_quantized=False)
    cfg = SimpleNamespace(distributed_config=dc)
    with pytest.raises(NotImplementedError, match="sharding plan"):
        q.update_tp_plan(cfg)
    with pytest.raises(NotImplementedError, match="sharding plan"):
        q.update_parallel_plan(SimpleNamespace(config=cfg), {})
    ok = SimpleNamespace(distributed_config=None)
    assert q.update_tp_plan(ok) is ok and q.update_ep_plan(ok) is ok
