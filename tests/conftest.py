"""Shared test helpers: tiny random decoder models built from configs (no Hub access here)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

_PYTEST_PID = os.getpid()


def _interrupt_on_sigterm(signum, frame):
    """SIGTERM (a device call's ``timeout``, the GPU suite stopping a part) becomes KeyboardInterrupt in pytest, so
    fixtures' finalizers and ``run_child`` stop the vLLM servers and engines a test started in their own sessions;
    killed outright, pytest once left 44 GiB held on a GPU (the server test's vLLM server) for the next device call.
    A forked child dies as SIGTERM would."""
    if os.getpid() != _PYTEST_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _interrupt_on_sigterm)

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def tiny_config(arch: str = "qwen2", **overrides):
    """A 2-layer config of the given family; every Linear has in_features divisible by 16."""
    from transformers import AutoConfig

    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        kw["head_dim"] = 16
    kw.update(overrides)
    return AutoConfig.for_model(arch, **kw)


def tiny_model(arch: str = "qwen2", dtype: torch.dtype = torch.bfloat16, seed: int = 0, **overrides):
    """A randomly initialised tiny causal LM (weights scaled up so quantization is non-trivial)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.eval()


#: The SmolLM2-135M-Instruct GGUF the GPU bundle unpacks (BUNDLE_EXTRA); the real small model of the GPU tests.
SMOLLM2_GGUF = os.environ.get("QERL_SMOLLM_GGUF", "/tmp/gpu-extra/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture
def smollm2_gguf() -> str:
    """The SmolLM2 GGUF path; skips without vLLM or the file."""
    pytest.importorskip("vllm")
    if not os.path.exists(SMOLLM2_GGUF):
        pytest.skip(f"SmolLM2 GGUF not found at {SMOLLM2_GGUF} (set QERL_SMOLLM_GGUF)")
    return SMOLLM2_GGUF


@pytest.fixture
def smollm2_checkpoints(smollm2_gguf, tmp_path):
    """``(bf16_dir, nvfp4_dir)`` of SmolLM2, made from the GGUF by ``qerl_trl.smollm2.prepare_smollm2`` (the demo's)."""
    import shutil

    from qerl_trl.smollm2 import GGUF_MEMBER, prepare_smollm2

    cache = tmp_path / "smollm2"
    (cache / GGUF_MEMBER).parent.mkdir(parents=True)
    shutil.copyfile(smollm2_gguf, cache / GGUF_MEMBER)
    return prepare_smollm2(cache)


def packed_lora(slot_rows: list[int], k: int, rank: int, dtype: torch.dtype, device: str, seed: int = 0,
                b_scale: float = 1.0):
    """A single-LoRA layer's stacked ``A``, block-diagonal ``B`` (random diagonal blocks times ``b_scale``, zeros
    elsewhere) and slot bounds, for a vLLM linear packing ``len(slot_rows)`` sub-modules."""
    from qerl_trl.vllm_plugin.lora_kernels import lora_slot_bounds

    g = torch.Generator().manual_seed(seed)
    s = len(slot_rows)
    a = torch.randn(s * rank, k, generator=g) / k**0.5
    b = torch.zeros(sum(slot_rows), s * rank)
    starts, start = [], 0
    for j, rows in enumerate(slot_rows):
        b[start : start + rows, j * rank : (j + 1) * rank] = torch.randn(rows, rank, generator=g) * b_scale
        starts.append(start)
        start += rows
    return a.to(device, dtype), b.to(device, dtype), lora_slot_bounds(starts, start, s * rank, device)


def has_cuda() -> bool:
    return torch.cuda.is_available()


#: the GPU suite (``-m "gpu or vllm"``) as this session collected it, before ``-m`` deselected anything: node id ->
#: (its markers' names, its keywords lower-cased: what ``-m`` and ``-k`` match, so ``tests/test_gpu_suite.py`` can
#: select each part's tests without collecting again); None when the session did not collect every test module
#: (that test then collects in child pytests)
GPU_SUITE_SEEN = pytest.StashKey[dict[str, tuple[frozenset[str], frozenset[str]]] | None]()


@pytest.hookimpl(tryfirst=True)  # before the ``-m`` option deselects anything
def pytest_collection_modifyitems(config, items):
    """Note the GPU suite's node ids (a whole-suite run costs nothing more; a child collection took 32 s on CI), then
    skip GPU tests on a machine without CUDA."""
    here = os.path.dirname(os.path.abspath(__file__))
    modules = {os.path.join(here, f) for f in os.listdir(here) if f.startswith("test_") and f.endswith(".py")}
    gpu = {}
    for item in items:
        marks = frozenset(m.name for m in item.iter_markers())
        if marks & {"gpu", "vllm"}:
            gpu[item.nodeid] = (marks, frozenset(str(k).lower() for k in item.keywords))
    config.stash[GPU_SUITE_SEEN] = gpu if modules <= {str(item.path) for item in items} else None
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine with `pytest -m gpu`)")
    vllm_on_cpu = os.environ.get("QERL_VLLM_ON_CPU") == "1"
    for item in items:
        if vllm_on_cpu and "vllm_on_cpu" in item.keywords:
            continue
        if "gpu" in item.keywords or "vllm" in item.keywords:
            item.add_marker(skip)
