"""NVFP4Config / NVFP4HfQuantizer: quantize-on-load of tiny Llama/Qwen2/Qwen3/Mistral checkpoints.

Runs on transformers 5.17.0 and the newest (scripts/test.sh selects ``-k quantizer``)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from torch import nn

import qerl_trl  # noqa: F401  (registers the quantizer)
from conftest import TINY_ARCHS, tiny_model
from qerl_trl.nvfp4 import NVFP4Linear
from qerl_trl.nvfp4 import format as nvfp4
from qerl_trl.quantizer import NVFP4Config, NVFP4HfQuantizer
from transformers import AutoModelForCausalLM

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",))


def _save_bf16(tmp_path, arch, **overrides):
    dense = tiny_model(arch, **overrides)
    path = tmp_path / f"{arch}-bf16"
    dense.save_pretrained(path)
    return dense, path


def _load_nvfp4(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config(**kw), dtype=torch.bfloat16)


def _expected(dense, layer: int):
    """format.quantize of every Linear of one layer, with the fused group's shared global scale."""
    blk = dense.model.layers[layer]
    mods = {n: (blk.self_attn if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else blk.mlp) for n in LINEARS}
    out = {}
    for group in GROUPS:
        ws = {n: getattr(mods[n], n).weight.data for n in group}
        gs = nvfp4.compute_global_scale(*ws.values())
        for n, w in ws.items():
            out[n] = nvfp4.quantize(w, global_scale=gs)
    return out


def _dense_dequantized(dense, model):
    """The 16-bit model with every quantized Linear's weight replaced by its dequantized NVFP4 weight."""
    ref = tiny_model(dense.config.model_type)
    ref.load_state_dict(dense.state_dict())
    for name, m in model.named_modules():
        if isinstance(m, NVFP4Linear):
            ref.get_submodule(name).weight.data.copy_(m.dequantize(torch.bfloat16))
    return ref


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_quantizer_load_matches_format_and_dense_dequantized(tmp_path, arch):
    dense, path = _save_bf16(tmp_path, arch)
    model = _load_nvfp4(path)

    assert isinstance(model.hf_quantizer, NVFP4HfQuantizer) and model.is_quantized
    assert model.quantization_method == "qerl_nvfp4"
    # embeddings, lm_head and norms stay 16-bit
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "norm" in n)
    for layer in range(dense.config.num_hidden_layers):
        expected = _expected(dense, layer)
        blk = model.model.layers[layer]
        for n in LINEARS:
            mod = getattr(blk.self_attn if hasattr(blk.self_attn, n) else blk.mlp, n)
            assert type(mod) is NVFP4Linear, n
            assert not hasattr(mod, "weight"), "the load-time placeholder must be gone"
            q = expected[n]
            assert torch.equal(mod.weight_packed, q.weight_packed), n
            assert torch.equal(mod.weight_scale.view(torch.uint8), q.weight_scale.view(torch.uint8)), n
            assert torch.equal(mod.weight_global_scale, q.weight_global_scale), n
        # q/k/v and gate/up share one global scale
        a = blk.self_attn
        assert a.q_proj.weight_global_scale.item() == a.k_proj.weight_global_scale.item() == a.v_proj.weight_global_scale.item()
        assert blk.mlp.gate_proj.weight_global_scale.item() == blk.mlp.up_proj.weight_global_scale.item()
    assert not any(p.requires_grad for m in model.modules() if isinstance(m, NVFP4Linear) for p in m.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())

    ref = _dense_dequantized(dense, model)
    ids = torch.randint(0, dense.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want, orig = model(ids).logits.float(), ref(ids).logits.float(), dense(ids).logits.float()
    err = (got - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), err
    # and quantization really changed the model (the comparison above could not pass by accident)
    assert (orig - want).abs().max().item() > 10 * max(err, 1e-6)


def test_quantizer_modules_to_not_convert_and_ignore_list(tmp_path):
    dense, path = _save_bf16(tmp_path, "llama")
    model = _load_nvfp4(path, modules_to_not_convert=["mlp.down_proj", "re:model\\.layers\\.1\\.self_attn\\.o_proj"])
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert type(model.model.layers[1].mlp.down_proj) is nn.Linear
    assert type(model.model.layers[1].self_attn.o_proj) is nn.Linear
    assert type(model.model.layers[0].self_attn.o_proj) is NVFP4Linear
    torch.testing.assert_close(model.model.layers[0].mlp.down_proj.weight, dense.model.layers[0].mlp.down_proj.weight)
    qc = model.config.quantization_config
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["ignore"] == sorted(
        ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.o_proj"]
    )


def test_quantizer_partial_fused_group_is_refused(tmp_path):
    _, path = _save_bf16(tmp_path, "qwen2")
    with pytest.raises(ValueError, match="must be quantized together"):
        _load_nvfp4(path, modules_to_not_convert=["k_proj"])


def test_quantizer_in_features_not_multiple_of_16_stays_16bit(tmp_path, caplog):
    dense, path = _save_bf16(tmp_path, "qwen3", intermediate_size=72)  # down_proj has in_features 72
    with caplog.at_level(logging.WARNING, logger="qerl_trl.quantizer.conversion"):
        model = _load_nvfp4(path)
    down = model.model.layers[0].mlp.down_proj
    assert type(down) is nn.Linear and down.weight.dtype == torch.bfloat16
    torch.testing.assert_close(down.weight, dense.model.layers[0].mlp.down_proj.weight)
    assert type(model.model.layers[0].mlp.gate_proj) is NVFP4Linear
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # one warning with the count and the reason; lm_head (16-bit by design) is not warned about
    assert len(warnings) == 1, warnings
    assert "2 of 15 Linear layers stay 16-bit: in_features not a multiple of 16" in warnings[0]
    assert "model.layers.0.mlp.down_proj" in warnings[0]
    assert "model.layers.0.mlp.down_proj" in model.config.quantization_config["ignore"]
    assert model.hf_quantizer.plan.kept["lm_head"] == "output embedding (lm_head), 16-bit by design"


def test_quantizer_user_skips_are_not_warned_and_nothing_converted_is_an_error(tmp_path, caplog):
    _, path = _save_bf16(tmp_path, "qwen2")
    with caplog.at_level(logging.WARNING, logger="qerl_trl.quantizer.conversion"):
        _load_nvfp4(path, modules_to_not_convert=["mlp"])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    _, odd = _save_bf16(tmp_path / "odd", "qwen2", hidden_size=72, intermediate_size=88)  # every in_features odd
    want = r"no Linear to quantize.*all 15 stay 16-bit \(14 in_features not a multiple of 16 .*; 1 output"
    with pytest.raises(ValueError, match=want):
        _load_nvfp4(odd)


def test_quantize_model_in_place_matches_quantize_on_load(tmp_path, caplog):
    """quantize_model (a model instance) and from_pretrained(NVFP4Config) give the same packed tensors, the same
    warnings and an NVFP4A16 quantization_config; the modules are replaced in the given object."""
    from qerl_trl.quantizer import quantize_model

    dense, path = _save_bf16(tmp_path, "qwen3", intermediate_size=72)
    loaded = _load_nvfp4(path)
    target = tiny_model("qwen3", intermediate_size=72)
    with caplog.at_level(logging.WARNING, logger="qerl_trl.quantizer.conversion"):
        plan = quantize_model(target)
    assert any("2 of 15 Linear layers stay 16-bit" in r.getMessage() for r in caplog.records)
    assert plan.kept == loaded.hf_quantizer.plan.kept
    assert target.config.quantization_config == loaded.config.quantization_config
    for name, m in loaded.named_modules():
        if isinstance(m, NVFP4Linear):
            mine = target.get_submodule(name)
            assert isinstance(mine, NVFP4Linear) and not mine.weight_packed.requires_grad
            for t in ("weight_packed", "weight_scale", "weight_global_scale"):
                assert torch.equal(getattr(mine, t).view(torch.uint8), getattr(m, t).view(torch.uint8)), (name, t)


def test_quantizer_refuses_a_moe_laid_out_otherwise_than_qwen3_moe(tmp_path):
    """Qwen3-MoE's experts are packed on load (tests/test_nvfp4_experts.py); Mixtral's router is
    ``block_sparse_moe.gate``, which the checkpoint's ``ignore`` (``re:.*mlp.gate$``) would not keep 16-bit."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        "mixtral", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1, head_dim=16,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "moe")
    with pytest.raises(NotImplementedError, match="experts or router are laid out otherwise"):
        _load_nvfp4(tmp_path / "moe")


def test_quantizer_missing_group_member_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = _save_bf16(tmp_path, "llama")
    sd = load_file(path / "model.safetensors")
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="k_proj.weight"):
        _load_nvfp4(path)


def test_quantizer_non_finite_weight_names_the_tensor(tmp_path, capfd, caplog):
    from safetensors.torch import load_file, save_file

    _, path = _save_bf16(tmp_path, "llama")
    sd = load_file(path / "model.safetensors")
    sd["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    # transformers collects conversion errors into its loading report and then raises; either way the load
    # fails and the message naming the tensor reaches the user
    with pytest.raises(Exception) as ei:
        _load_nvfp4(path)
    shown = str(ei.value) + capfd.readouterr().err + caplog.text
    assert "model.layers.0.mlp.up_proj.weight" in shown and "non-finite" in shown


def test_quantizer_trainer_flags(tmp_path):
    from transformers.trainer_utils import validate_quantization_for_training

    _, path = _save_bf16(tmp_path, "qwen2")
    model = _load_nvfp4(path)
    hq = model.hf_quantizer
    assert hq.is_trainable is True and hq.is_qat_trainable is False and hq.is_serializable() is True
    # a bare packed model is refused by Trainer's check (an adapter is required) ...
    with pytest.raises(ValueError, match="purely quantized"):
        validate_quantization_for_training(model)
    # ... and accepted once it carries one (what PEFT sets on the model)
    model._hf_peft_config_loaded = True
    validate_quantization_for_training(model)


def test_quantizer_dequantize_gives_back_dense_linears(tmp_path):
    dense, path = _save_bf16(tmp_path, "mistral")
    model = _load_nvfp4(path)
    ref = _dense_dequantized(dense, model)
    model.dequantize()
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    for (n, p), (n2, p2) in zip(model.named_parameters(), ref.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n


def test_quantizer_registration_adds_only_our_method():
    code = (
        "import json, transformers.quantizers.auto as a\n"
        "before = (dict(a.AUTO_QUANTIZER_MAPPING), dict(a.AUTO_QUANTIZATION_CONFIG_MAPPING))\n"
        "import qerl_trl, importlib; importlib.reload(qerl_trl.quantizer)\n"
        "after = (a.AUTO_QUANTIZER_MAPPING, a.AUTO_QUANTIZATION_CONFIG_MAPPING)\n"
        "out = [sorted(set(x) - set(b)) for x, b in zip(after, before)]\n"
        "out.append(all(after[i][k] is before[i][k] for i in (0, 1) for k in before[i]))\n"
        "from transformers import BitsAndBytesConfig\n"
        "from transformers.quantizers.auto import AutoHfQuantizer\n"
        "q = AutoHfQuantizer.from_config({'quant_method': 'bitsandbytes', 'load_in_4bit': True})\n"
        "out.append(type(q).__name__)\n"
        "print(json.dumps(out))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    added_q, added_c, unchanged, bnb = json.loads(res.stdout.strip().splitlines()[-1])
    assert added_q == ["qerl_nvfp4"] and added_c == ["qerl_nvfp4"] and unchanged is True
    assert bnb == "Bnb4BitHfQuantizer"


def test_quantizer_plain_bf16_checkpoint_unchanged_by_import(tmp_path):
    dense, path = _save_bf16(tmp_path, "qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert getattr(model, "hf_quantizer", None) is None and not any(isinstance(m, NVFP4Linear) for m in model.modules())
    for (n, p), (n2, p2) in zip(model.state_dict().items(), dense.state_dict().items()):
        assert n == n2 and torch.equal(p, p2)


def test_quantizer_config_roundtrip_and_validation():
    cfg = NVFP4Config(modules_to_not_convert="lm_head", fused_groups=[["a", "b"]])
    again = NVFP4Config.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict() and again.modules_to_not_convert == ["lm_head"]
    with pytest.raises(ValueError, match="qerl_nvfp4"):
        NVFP4Config(quant_method="nvfp4")
    with pytest.raises(TypeError, match="unexpected"):
        NVFP4Config(group_size=32)
