"""A LoRA on the routed experts of a packed NVFP4 MoE layer (issue #54 item 3), on CPU with a tiny Qwen3-MoE: what
it computes (each expert's gate, up and down plus ``s * B_e A_e``, against transformers' experts on the dequantized
weights plus the same LoRA), what trains (only the adapters), and how it saves and loads (per expert, as vLLM's MoE
LoRA reads an adapter)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qerl_trl.nvfp4.experts import NVFP4Experts  # noqa: E402
from qerl_trl.peft_lora import NVFP4ExpertsLora  # noqa: E402
from qerl_trl.quantizer import quantize_model  # noqa: E402
from tests.test_nvfp4_experts import dense_reference, expert_pass, tiny_moe  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]


def packed_moe(seed: int = 0) -> nn.Module:
    """The tiny Qwen3-MoE, packed in NVFP4 (experts included)."""
    model = tiny_moe(seed, dtype=torch.float32)
    quantize_model(model)
    return model


def _peft(model: nn.Module, r: int = 8, **kw):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, lora_dropout=0.0, **kw))


def _randomize_b(peft_model: nn.Module) -> None:
    """Non-zero B everywhere (a trained adapter), so every check sees the LoRA's term."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _reference_with_lora(layer: NVFP4ExpertsLora, original: nn.Module):
    """transformers' experts on the dequantized weights, with each expert's LoRA added to its weights (W + s B A)."""
    base = layer.get_base_layer()
    ref = dense_reference(base, original)
    a, b, s = layer.lora_A["default"], layer.lora_B["default"], layer.scaling["default"]
    with torch.no_grad():
        for e in range(base.num_experts):
            gate = (b.experts_gate[e].float() @ a.experts_gate[e].float()) * s
            up = (b.experts_up[e].float() @ a.experts_up[e].float()) * s
            ref.gate_up_proj[e] += torch.cat([gate, up])
            ref.down_proj[e] += (b.experts_down[e].float() @ a.experts_down[e].float()) * s
    return ref


@pytest.mark.parametrize("grouped", [True, False])
def test_the_expert_lora_computes_each_experts_weights_plus_its_lora(grouped, monkeypatch):
    original = tiny_moe(dtype=torch.float32)
    experts_ref = original.model.layers[0].mlp.experts
    model = packed_moe()
    peft_model = _peft(model)
    layer = peft_model.base_model.model.model.layers[0].mlp.experts
    assert isinstance(layer, NVFP4ExpertsLora) and isinstance(layer.get_base_layer(), NVFP4Experts)
    _randomize_b(peft_model)
    ref = _reference_with_lora(layer, experts_ref)
    g = torch.Generator().manual_seed(1)
    tokens, k = 24, original.config.num_experts_per_tok
    n = layer.get_base_layer().num_experts
    x = torch.randn(tokens, layer.get_base_layer().hidden, generator=g)
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g)
    grad = torch.randn(tokens, layer.get_base_layer().hidden, generator=g)
    dtype = torch.bfloat16 if grouped else torch.float32
    layer.to(dtype)
    got = expert_pass(layer, x.to(dtype), idx, w.to(dtype), grad.to(dtype), monkeypatch, grouped=grouped)
    want = expert_pass(ref, x, idx, w, grad, monkeypatch)
    tol = 3e-2 if grouped else 1e-4  # bf16 activations and adapters on the grouped path
    for g_, w_ in zip(got, want):
        assert ((g_ - w_).abs().max() / w_.abs().max()) < tol
    # the LoRA's term is there: without it the output differs
    with peft_model.disable_adapter():
        bare = expert_pass(layer, x.to(dtype), idx, w.to(dtype), grad.to(dtype), monkeypatch, grouped=grouped)[0]
    assert ((bare - want[0]).abs().max() / want[0].abs().max()) > 10 * tol


def test_only_the_adapters_train_and_a_fresh_lora_changes_nothing():
    model = packed_moe()
    layer0 = model.model.layers[0].mlp.experts
    x = torch.randn(2, 5, model.config.hidden_size)
    before = model.model.layers[0].mlp(x)
    peft_model = _peft(model)
    layer = peft_model.base_model.model.model.layers[0].mlp.experts
    assert layer.get_base_layer() is layer0
    assert torch.allclose(peft_model.base_model.model.model.layers[0].mlp(x), before, atol=1e-6)  # B = 0
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert {n for n in trainable if ".mlp.experts." in n} == {
        f"base_model.model.model.layers.{i}.mlp.experts.{side}.default.experts_{p}"
        for i in range(model.config.num_hidden_layers) for side in ("lora_A", "lora_B") for p in ("gate", "up", "down")}
    assert not any("packed" in n or "scale" in n for n in trainable)
    _randomize_b(peft_model)
    out = peft_model.base_model.model.model.layers[0].mlp(x.requires_grad_(True))
    out.square().mean().backward()
    a, b = layer.lora_A["default"], layer.lora_B["default"]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (*a.parameters(), *b.parameters()))
    assert layer0.gate_up_packed.grad is None


def test_the_expert_adapter_checkpoint_is_per_expert_as_vllm_reads_it_and_loads_back(tmp_path):
    from peft import PeftModel

    model = packed_moe()
    peft_model = _peft(model, r=8)
    _randomize_b(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    cfg = model.config
    n, hidden, width = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for layer in range(cfg.num_hidden_layers):
        for e in range(n):
            stem = f"base_model.model.model.layers.{layer}.mlp.experts.{e}"
            assert saved[f"{stem}.gate_proj.lora_A.weight"].shape == (8, hidden)
            assert saved[f"{stem}.gate_proj.lora_B.weight"].shape == (width, 8)
            assert saved[f"{stem}.up_proj.lora_A.weight"].shape == (8, hidden)
            assert saved[f"{stem}.down_proj.lora_A.weight"].shape == (8, width)
            assert saved[f"{stem}.down_proj.lora_B.weight"].shape == (hidden, 8)
    assert not any("experts_" in k for k in saved)  # no stacked name reaches the file
    # vLLM 0.24 reads a 2-D MoE adapter by these module names (lora.utils.process_packed_modules_mapping: the expert
    # mapping's "experts.<e>.gate_proj" ...; lora_model.check_unexpected_modules takes the name after ".experts")
    names = {k.split(".lora_")[0].split(".mlp.")[-1] for k in saved if ".mlp.experts." in k}
    assert names == {f"experts.{e}.{p}" for e in range(n) for p in ("gate_proj", "up_proj", "down_proj")}
    assert "experts" in json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]

    x = torch.randn(2, 5, cfg.hidden_size)
    want = peft_model(inputs_embeds=x).logits
    fresh = PeftModel.from_pretrained(packed_moe(), tmp_path / "adapter")
    assert torch.allclose(fresh(inputs_embeds=x).logits, want, atol=1e-5)
    layer = fresh.base_model.model.model.layers[0].mlp.experts
    assert isinstance(layer, NVFP4ExpertsLora)


def test_a_partial_adapter_is_an_error_that_names_the_missing_experts(tmp_path):
    from peft import set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict

    peft_model = _peft(packed_moe())
    state = get_peft_model_state_dict(peft_model)
    state.pop(next(k for k in state if ".experts.1.down_proj.lora_B" in k))
    with pytest.raises(ValueError, match=r"missing experts|missing e.g. \[1\]"):
        set_peft_model_state_dict(peft_model, state)
    from qerl_trl.peft_lora import experts_lora_stacked

    with pytest.raises(ValueError, match=r"missing e.g. \[1\]"):  # the per-expert layout, as saved
        experts_lora_stacked(peft_model, {k.replace(".default", ""): v for k, v in state.items()})


def test_what_the_expert_lora_cannot_be_is_refused():
    for kw, message in [({"lora_dropout": 0.1}, "without dropout"), ({"use_dora": True}, "plain LoRA only"),
                        ({"r": 4}, "multiple of 8")]:
        with pytest.raises(ValueError, match=message):
            from peft import LoraConfig, get_peft_model

            get_peft_model(packed_moe(),
                           LoraConfig(**{"r": 8, "target_modules": ["experts"], **kw}))  # fmt: skip
    peft_model = _peft(packed_moe())
    from qerl_trl.peft_lora import NVFP4MergeError

    with pytest.raises(NVFP4MergeError):
        peft_model.merge_and_unload()


def test_on_a_bf16_model_the_expert_adapters_are_bf16():
    """PEFT upcasts bf16 adapters to fp32 by default; QeRL keeps a bf16 model's adapters in bf16 (as on its Linears)."""
    model = tiny_moe(dtype=torch.bfloat16)
    quantize_model(model)
    layer = _peft(model).base_model.model.model.layers[0].mlp.experts
    assert {p.dtype for p in layer.lora_A.parameters()} == {p.dtype for p in layer.lora_B.parameters()} == {
        torch.bfloat16}


@pytest.mark.vllm_on_cpu
def test_vllms_lora_loader_reads_the_saved_expert_adapter(tmp_path, monkeypatch):
    """vLLM 0.24's own code: with the module names its Qwen3-MoE LoRA expects (the expert mapping's
    ``experts.<e>.gate_proj`` ..., as ``lora.utils.process_packed_modules_mapping`` builds them for a 2-D MoE model,
    and the attention's), ``LoRAModel.from_local_checkpoint`` loads the saved adapter: no unexpected module, each
    expert's A and B at the rank and shapes trained. Serving it in an engine is not built yet (GPU)."""
    pytest.importorskip("vllm")
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(platforms, "_current_platform", CpuPlatform())  # a CUDA build of vLLM without a GPU
    from vllm.lora import lora_model
    from vllm.lora.lora_model import LoRAModel

    monkeypatch.setattr(lora_model, "PIN_MEMORY", False)  # read at import time from the CUDA platform
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    model = packed_moe()
    peft_model = _peft(model)
    _randomize_b(peft_model)
    peft_model.save_pretrained(tmp_path)
    cfg = model.config
    mapping = RoutedExperts.make_expert_params_mapping(torch.nn.Module(), "gate_proj", "down_proj", "up_proj",
                                                       cfg.num_experts)  # fmt: skip
    expected = {weight.rstrip(".") for _, weight, _, _ in mapping} | {"qkv_proj", "o_proj", "q_proj", "k_proj",
                                                                      "v_proj"}  # fmt: skip
    helper = PEFTHelper.from_local_dir(str(tmp_path), max_position_embeddings=None)
    lora = LoRAModel.from_local_checkpoint(str(tmp_path), expected, helper, lora_model_id=1, device="cpu",
                                           dtype=torch.float32)  # fmt: skip
    layer = peft_model.base_model.model.model.layers[1].mlp.experts
    a, b = layer.lora_A["default"], layer.lora_B["default"]
    got = lora.loras["model.layers.1.mlp.experts.3.down_proj"]
    assert got.rank == 8 and torch.equal(got.lora_a, a.experts_down[3].detach())
    want_b = b.experts_down[3].detach()
    assert torch.equal(got.lora_b, want_b) or torch.allclose(got.lora_b, want_b * layer.scaling["default"])
    gate = lora.loras["model.layers.0.mlp.experts.0.gate_proj"]
    assert tuple(gate.lora_a.shape) == (8, cfg.hidden_size)
    assert tuple(gate.lora_b.shape) == (cfg.moe_intermediate_size, 8)
    # the "vllm" backend's in-place refresh hands vLLM the same tensors without files (from_lora_tensors)
    from qerl_trl.trainer.vllm_serving import peft_to_vllm_lora_tensors

    sent = peft_to_vllm_lora_tensors(peft_model, copy=True)
    fresh = LoRAModel.from_lora_tensors(2, sent, helper, device="cpu", dtype=torch.float32)
    assert fresh.loras.keys() == lora.loras.keys()
    assert torch.equal(fresh.loras["model.layers.1.mlp.experts.3.down_proj"].lora_a, got.lora_a)


def test_the_vllm_backend_sends_the_expert_lora_per_expert_and_the_in_layer_backend_refuses_it():
    """The "vllm" backend's sync reads the adapter in PEFT's saved per-expert layout (what vLLM's loader and its
    in-place refresh take); QeRL's in-layer method serves Linears only, and says which backend serves experts."""
    from peft.utils import get_peft_model_state_dict

    from qerl_trl.trainer.vllm_serving import peft_lora_modules, peft_to_vllm_lora_tensors

    peft_model = _peft(packed_moe())
    _randomize_b(peft_model)
    sent = peft_to_vllm_lora_tensors(peft_model)
    saved = get_peft_model_state_dict(peft_model)
    assert sent.keys() == saved.keys() and all(torch.equal(sent[k], saved[k]) for k in saved)
    copied = peft_to_vllm_lora_tensors(peft_model, copy=True)  # the caller's own: vLLM scales B in place
    layer = peft_model.base_model.model.model.layers[0].mlp.experts
    stack = layer.lora_B["default"].experts_gate
    key = "base_model.model.model.layers.0.mlp.experts.2.gate_proj.lora_B.weight"
    assert torch.equal(copied[key], sent[key]) and copied[key].data_ptr() != sent[key].data_ptr()
    copied[key].mul_(2.0)
    assert torch.equal(stack[2], sent[key])  # the trained stack is untouched
    with pytest.raises(ValueError, match="vllm_lora_backend='vllm'"):
        peft_lora_modules(peft_model)
