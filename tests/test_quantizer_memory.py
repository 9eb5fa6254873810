"""Quantize-on-load keeps the peak at ~ packed model + one layer, never the whole 16-bit model.

Measured with glibc's ``mallinfo2`` (all heap + mmapped malloc blocks: torch CPU tensors *and* the buffers
safetensors reads checkpoint tensors into; the checkpoint file's own mmap is not counted), sampled by a
background thread every ~0.2 ms and at every NVFP4 quantize call. The same measurement on a plain 16-bit load
shows it sees the whole model.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time

import pytest
import torch

import qerl_trl  # noqa: F401
from conftest import tiny_model
from qerl_trl.nvfp4 import NVFP4Linear
from qerl_trl.quantizer import NVFP4Config, conversion
from transformers import AutoModelForCausalLM


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def _mallinfo():
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    fn.restype = _MallInfo2

    def used() -> int:
        m = fn()
        return m.uordblks + m.hblkhd

    return used


class PeakSampler:
    def __init__(self, used):
        self.used, self.peak, self._stop = used, 0, threading.Event()

    def sample(self):
        self.peak = max(self.peak, self.used())

    def __enter__(self):
        gc.collect()
        self.base = self.used()
        self.peak = self.base
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            time.sleep(0.0002)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.sample()

    @property
    def rise(self) -> int:
        return self.peak - self.base


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.slow
def test_quantizer_load_peak_is_packed_plus_one_layer(tmp_path, monkeypatch):
    used = _mallinfo()
    kw = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2)
    dense = tiny_model("llama", **kw)
    # an fp32 checkpoint loaded as bf16: every tensor read is a real (malloc'd) bf16 copy, as it is on a GPU.
    # (A bf16 checkpoint on CPU would be used straight from the file's mmap, which malloc statistics don't see.)
    dense.float().save_pretrained(tmp_path / "bf16")
    dense.to(torch.bfloat16)
    full_16bit = _nbytes(dense.parameters())
    layer_16bit = _nbytes(dense.model.layers[0].parameters())
    del dense
    gc.collect()
    # quantize in 64K-element row chunks so float32 temporaries stay far below one layer at this small size
    # (the default, 4M elements, plays the same role for 7B-sized layers)
    monkeypatch.setattr(conversion, "CHUNK_ELEMENTS", 1 << 16)

    sampler = PeakSampler(used)
    orig = conversion.quantize_group

    def sampled(weights):
        sampler.sample()  # the group's 16-bit tensors are all alive here
        out = orig(weights)
        sampler.sample()
        return out

    monkeypatch.setattr(conversion, "quantize_group", sampled)
    with sampler:
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path / "bf16", quantization_config=NVFP4Config(), dtype=torch.bfloat16
        )
    quant_rise = sampler.rise
    resident = _nbytes(model.parameters()) + _nbytes(model.buffers())
    packed = _nbytes(p for m in model.modules() if isinstance(m, NVFP4Linear) for p in m.parameters())
    # exact count of what the quantizer itself buffered: at most one fused group (gate+up), less than a layer
    held = model.hf_quantizer.max_pending_bytes
    assert 0 < held < layer_16bit
    bound = resident + layer_16bit + 4 * 2**20  # + python/transformers bookkeeping
    print(
        f"\n16-bit model {full_16bit / 2**20:.1f} MiB, one layer {layer_16bit / 2**20:.1f} MiB, "
        f"resident after load {resident / 2**20:.1f} MiB (packed {packed / 2**20:.1f}); buffered 16-bit <= {held / 2**20:.1f} MiB; "
        f"peak rise during NVFP4 load {quant_rise / 2**20:.1f} MiB (bound {bound / 2**20:.1f})"
    )
    assert quant_rise <= bound, (quant_rise, bound)
    assert quant_rise < 0.6 * full_16bit
    del model
    gc.collect()

    # the same probe sees a plain 16-bit load hold the whole model: it can tell the two apart
    with PeakSampler(used) as s16:
        dense_again = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    print(f"peak rise during plain bf16 load {s16.rise / 2**20:.1f} MiB")
    assert s16.rise >= 0.9 * full_16bit
    del dense_again
