"""compressed-tensors NVFP4A16 checkpoints: what save_pretrained writes, who can read it, load_nvfp4 round trips.

Runs on transformers 5.17.0 and the newest (scripts/test.sh selects ``-k checkpoint``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import qerl_trl
from conftest import tiny_model
from qerl_trl.nvfp4 import NVFP4Linear
from qerl_trl.quantizer import NVFP4Config, NVFP4HfQuantizer, compressed_tensors_config, nvfp4a16_problems
from transformers import AutoModelForCausalLM

ct = pytest.importorskip("compressed_tensors")


def _quantized(tmp_path, arch="qwen2", **cfg):
    dense = tiny_model(arch)
    dense.save_pretrained(tmp_path / "bf16")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", quantization_config=NVFP4Config(**cfg), dtype=torch.bfloat16
    )
    return dense, model


def _ids(vocab=256):
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))


def test_checkpoint_layout_and_config(tmp_path):
    from safetensors import safe_open

    _, model = _quantized(tmp_path)
    model.save_pretrained(tmp_path / "nvfp4")
    cfg = json.loads((tmp_path / "nvfp4" / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc == compressed_tensors_config(["lm_head"])
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    with safe_open(str(tmp_path / "nvfp4" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        p = "model.layers.0.self_attn.q_proj."
        assert {p + "weight_packed", p + "weight_scale", p + "weight_global_scale", p + "bias"} <= keys
        assert p + "weight" not in keys
        assert f.get_tensor(p + "weight_packed").dtype == torch.uint8
        assert tuple(f.get_tensor(p + "weight_packed").shape) == (64, 32)
        assert f.get_tensor(p + "weight_scale").dtype == torch.float8_e4m3fn
        assert tuple(f.get_tensor(p + "weight_scale").shape) == (64, 4)
        assert f.get_tensor(p + "weight_global_scale").dtype == torch.float32
        assert tuple(f.get_tensor(p + "weight_global_scale").shape) == (1,)
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16


def test_checkpoint_config_is_compressed_tensors_nvfp4a16_preset():
    """compressed-tensors itself parses our config, and its weight args equal its NVFP4A16 preset's."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    d = compressed_tensors_config(["lm_head"])
    parsed = QuantizationConfig.model_validate({k: v for k, v in d.items() if k not in ("sparsity_config", "transform_config")})
    preset = preset_name_to_scheme("NVFP4A16", ["Linear"])
    ours, theirs = parsed.config_groups["group_0"].weights, preset.weights
    # `observer` is calibration-only metadata; its default moved from "memoryless_minmax" (compressed-tensors 0.17,
    # which vLLM 0.24 pins and whose serialization we copy) to None (0.20)
    for field in type(ours).model_fields:
        if field != "observer":
            assert getattr(ours, field) == getattr(theirs, field), field
    assert parsed.config_groups["group_0"].input_activations is None
    assert parsed.format == "nvfp4-pack-quantized" and parsed.ignore == ["lm_head"]
    assert nvfp4a16_problems(d) == []
    w4a4 = json.loads(json.dumps(d))
    w4a4["config_groups"]["group_0"]["input_activations"] = dict(d["config_groups"]["group_0"]["weights"])
    assert any("input activations" in p for p in nvfp4a16_problems(w4a4))
    assert nvfp4a16_problems({"quant_method": "bitsandbytes"})


def test_checkpoint_read_by_transformers_compressed_tensors_without_qerl(tmp_path):
    """transformers + compressed-tensors (never importing qerl_trl) decompress our checkpoint to our logits."""
    _, model = _quantized(tmp_path, "llama")
    model.save_pretrained(tmp_path / "nvfp4")
    ids = _ids()
    torch.save(ids, tmp_path / "ids.pt")
    code = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'nvfp4')!r}, dtype=torch.bfloat16)
        assert type(m.hf_quantizer).__name__ == "CompressedTensorsHfQuantizer", type(m.hf_quantizer)
        assert "qerl_trl" not in sys.modules
        with torch.no_grad():
            torch.save(m(torch.load({str(tmp_path / 'ids.pt')!r})).logits.float(), {str(tmp_path / 'ct_logits.pt')!r})
        print("linear types:", sorted({{type(x).__name__ for x in m.modules() if "Linear" in type(x).__name__}}))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = torch.load(tmp_path / "ct_logits.pt")
    with torch.no_grad():
        ours = model(ids).logits.float()
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-2 * ours.abs().max().item(), err


def test_checkpoint_save_load_save_is_byte_identical(tmp_path):
    dense, model = _quantized(tmp_path, "qwen3", modules_to_not_convert=["mlp.down_proj"])
    model.save_pretrained(tmp_path / "a")
    again = qerl_trl.load_nvfp4(tmp_path / "a", dtype=torch.bfloat16)
    assert isinstance(again.hf_quantizer, NVFP4HfQuantizer) and again.hf_quantizer.pre_quantized
    assert type(again.model.layers[0].self_attn.q_proj) is NVFP4Linear
    assert type(again.model.layers[0].mlp.down_proj) is nn.Linear
    assert not any(p.requires_grad for m in again.modules() if isinstance(m, NVFP4Linear) for p in m.parameters())
    for (n, p), (n2, p2) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n == n2 and p.dtype == p2.dtype and torch.equal(p.view(torch.uint8), p2.view(torch.uint8)), n
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    again.save_pretrained(tmp_path / "b")
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_checkpoint_plain_from_pretrained_after_import_uses_compressed_tensors(tmp_path):
    """Importing qerl_trl does not hijack compressed-tensors checkpoints: plain from_pretrained decompresses."""
    _, model = _quantized(tmp_path, "mistral")
    model.save_pretrained(tmp_path / "nvfp4")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "nvfp4", dtype=torch.bfloat16)
    assert type(plain.hf_quantizer).__name__ == "CompressedTensorsHfQuantizer"
    assert not any(isinstance(m, NVFP4Linear) for m in plain.modules())


def test_checkpoint_load_nvfp4_quantizes_16bit_and_refuses_other_schemes(tmp_path):
    dense = tiny_model("llama")
    dense.save_pretrained(tmp_path / "bf16")
    model = qerl_trl.load_nvfp4(tmp_path / "bf16", dtype=torch.bfloat16)
    assert type(model.model.layers[1].mlp.up_proj) is NVFP4Linear and not model.hf_quantizer.pre_quantized
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not an NVFP4A16"):
        qerl_trl.load_nvfp4(tmp_path / "bf16")


def test_checkpoint_compressed_tensors_made_nvfp4a16_loads_packed(tmp_path):
    """A checkpoint compressed by compressed-tensors' own NVFP4 compressor (what llm-compressor saves) loads
    packed: its tensors land bit for bit in NVFP4Linear and the logits match transformers' decompression."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization import preset_name_to_scheme

    dense = tiny_model("qwen2")
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    qcfg = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format="nvfp4-pack-quantized")
    apply_quantization_config(dense, qcfg)
    # calibrate the weight qparams as llm-compressor's weight observer does (fused groups share global scale)
    from qerl_trl.nvfp4 import format as nvfp4

    for name, m in dense.named_modules():
        if hasattr(m, "weight_global_scale") and isinstance(m, nn.Linear):
            parent = dense.get_submodule(name.rpartition(".")[0])
            sibs = [getattr(parent, s) for s in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") if hasattr(parent, s)]
            group = sibs if name.rsplit(".", 1)[1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") else [m]
            gs = nvfp4.compute_global_scale(*[x.weight for x in group])
            q = nvfp4.quantize(m.weight.data, global_scale=gs)
            m.weight_global_scale.data.copy_(gs)
            m.weight_scale.data.copy_(q.weight_scale.to(m.weight_scale.dtype))
    compressor = ModelCompressor(quantization_config=qcfg)
    compressor.compress_model(dense)
    dense.save_pretrained(tmp_path / "ct")
    compressor.update_config(tmp_path / "ct")
    assert nvfp4a16_problems(json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]) == []

    ours = qerl_trl.load_nvfp4(tmp_path / "ct", dtype=torch.bfloat16)
    assert type(ours.model.layers[0].self_attn.k_proj) is NVFP4Linear
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        for k in f.keys():
            if k.endswith(("weight_packed", "weight_scale", "weight_global_scale")):
                assert torch.equal(f.get_tensor(k).view(torch.uint8), ours.get_parameter(k).view(torch.uint8)), k
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.bfloat16)
    ids = _ids()
    with torch.no_grad():
        a, b = ours(ids).logits.float(), plain(ids).logits.float()
    assert (a - b).abs().max().item() <= 1e-2 * b.abs().max().item()
