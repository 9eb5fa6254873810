"""``NVFP4Experts`` and ``quantize_model`` on a mixture-of-experts model (issue #54), on CPU with a tiny Qwen3-MoE:
the packed experts compute what transformers' experts compute on their dequantized weights, forward and backward,
stay frozen, and save per expert in the layout ``benchmarks/random_models.py`` writes (which vLLM's mapping reads)."""

from __future__ import annotations

import copy
import json
import os
import sys
import types

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import random_models as rm  # noqa: E402
from qerl_trl.nvfp4 import NVFP4Linear  # noqa: E402
from qerl_trl.nvfp4.experts import NVFP4Experts  # noqa: E402
from qerl_trl.quantizer import quantize_model  # noqa: E402
from qerl_trl.quantizer.moe import MoENotSupportedError  # noqa: E402
from tests.test_random_models import MOE_TINY, _tensors  # noqa: E402


def tiny_moe(seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(rm.qwen3_moe_config("qwen3-30b-a3b", **MOE_TINY), dtype=dtype)
    with torch.no_grad():  # std 0.05, not transformers' 0.02: the experts' codes span E2M1's range
        for p in model.parameters():
            if p.ndim == 3:
                p.normal_(0.0, 0.05)
    return model


def dense_reference(experts: NVFP4Experts, original: nn.Module) -> nn.Module:
    """transformers' own experts module holding the dequantized weights of ``experts``."""
    ref = copy.deepcopy(original)
    with torch.no_grad():
        for e in range(experts.num_experts):
            ref.gate_up_proj[e] = experts.dequantize("gate_up", e, torch.float32)
            ref.down_proj[e] = experts.dequantize("down", e, torch.float32)
    return ref


def expert_pass(module, x, idx, w, grad, monkeypatch, grouped: bool = True):
    """``(output, d hidden states, d routing weights)`` of one forward and backward, in float32; ``grouped=False``
    makes :class:`NVFP4Experts` take its per-expert loop."""
    from qerl_trl.nvfp4 import experts as ex

    with monkeypatch.context() as m:
        if not grouped:
            m.setattr(ex, "grouped_mm_usable", lambda t: False)
        xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = module(xa, idx, wa)
        y.backward(grad)
    return y.detach().float(), xa.grad.float(), wa.grad.float()


def assert_near(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16 accumulation orders may differ; a wrong expert or gradient is off by far more."""
    assert ((a - b).norm() / b.norm()).item() < 1e-2, ((a - b).norm() / b.norm()).item()


def test_experts_compute_transformers_expert_pass_on_the_dequantized_weights_forward_and_backward():
    original = tiny_moe().model.layers[0].mlp.experts
    packed = NVFP4Experts.from_experts(original)
    ref = dense_reference(packed, original)
    tokens, k = 11, 2
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 64, generator=gen, requires_grad=True)
    idx = torch.stack([torch.randperm(4, generator=gen)[:k] for _ in range(tokens)])
    idx[0] = torch.tensor([3, 3 - 1])
    w = torch.rand(tokens, k, generator=gen).softmax(-1).requires_grad_(True)
    x_ref, w_ref = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)

    y, y_ref = packed(x, idx, w), ref(x_ref, idx, w_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)  # the hidden states, toward LoRA below
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)  # the routing weights, toward the router
    assert not any(p.requires_grad for p in packed.parameters()) and all(p.grad is None for p in packed.parameters())
    # NVFP4's rounding of each expert, not a wrong expert: the packed output is near the 16-bit experts'
    y_bf16 = original(x.detach(), idx, w.detach())
    assert ((y.detach() - y_bf16).norm() / y_bf16.norm()).item() < 0.2


def test_routing_that_leaves_experts_idle_or_sends_every_token_to_one():
    """The tokens are sorted by expert into slices: idle experts, one expert taking every slot, and a token routed
    twice to one expert still give transformers' pass."""
    original = tiny_moe(seed=2).model.layers[0].mlp.experts
    packed = NVFP4Experts.from_experts(original)
    ref = dense_reference(packed, original)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen)
    for idx in (torch.full((5, 1), 2), torch.tensor([[1, 1], [1, 3], [3, 1], [1, 1], [3, 3]])):
        w = torch.rand(idx.shape, generator=gen)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        wa, wb = w.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y, y_ref = packed(xa, idx, wa), ref(xb, idx, wb)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
        y.sum().backward()
        y_ref.sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(wa.grad, wb.grad, rtol=1e-5, atol=1e-6)


def test_bf16_experts_take_one_grouped_gemm_a_projection_with_the_loops_results(monkeypatch):
    """In bf16 (where torch has a grouped GEMM: CUDA sm_80+ or the CPU, torch >= 2.9) each projection is one grouped
    GEMM over the dequantized stack, as transformers runs BF16 experts; outputs and gradients match the per-expert
    loop and transformers' pass on the same weights."""
    from qerl_trl.nvfp4 import experts as ex

    original = tiny_moe(seed=4, dtype=torch.bfloat16).model.layers[0].mlp.experts
    packed = NVFP4Experts.from_experts(original)
    ref = dense_reference(packed, original)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(13, 64, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(13)])
    idx[:, 0] = 1  # expert 1 takes every token once, some experts few or none
    w = torch.rand(13, 2, generator=gen).softmax(-1).to(torch.bfloat16)
    grad = torch.randn(13, 64, generator=gen).to(torch.bfloat16)
    assert ex.grouped_mm_usable(x), "this CPU torch has no grouped GEMM: the test would check nothing"
    stacks = []
    original_stack = NVFP4Experts.dequantize_stack

    def recording_stack(self, stack, like):
        stacks.append(stack)
        return original_stack(self, stack, like)

    monkeypatch.setattr(NVFP4Experts, "dequantize_stack", recording_stack)

    grouped = expert_pass(packed, x, idx, w, grad, monkeypatch)
    assert stacks == ["gate_up", "down", "down", "gate_up"]  # forward, then backward dequantizes again
    loop = expert_pass(packed, x, idx, w, grad, monkeypatch, grouped=False)
    assert len(stacks) == 4
    for a, b in zip(grouped, loop):
        assert_near(a, b)
    for a, b in zip(grouped, expert_pass(ref, x, idx, w, grad, monkeypatch)):
        assert_near(a, b)
    assert not ex.grouped_mm_usable(x.float()) and not ex.grouped_mm_usable(x.half())


def test_gate_and_up_share_each_experts_global_scale_and_dtypes_survive_a_cast():
    original = tiny_moe().model.layers[1].mlp.experts
    packed = NVFP4Experts.from_experts(original)
    from qerl_trl.nvfp4 import compute_global_scale

    before = {n: p.clone() for n, p in packed.named_parameters()}
    for e in range(4):
        want = compute_global_scale(original.gate_up_proj[e].detach())  # over gate and up together
        assert packed.tensors("gate_up")[2][e].item() == want.item()
    packed.to(torch.bfloat16)  # as model.to(bf16) does: the bit patterns are integers, so nothing is cast
    assert all(torch.equal(p, before[n]) and p.dtype == before[n].dtype for n, p in packed.named_parameters())
    assert [t.dtype for t in packed.tensors("down")] == [torch.uint8, torch.float8_e4m3fn, torch.float32]
    with pytest.raises(ValueError, match="divisible by 16"):
        NVFP4Experts(4, 64, 24, torch.nn.functional.silu)


def test_quantizer_packs_every_layers_experts_and_attention_and_trains_through_them():
    model = tiny_moe()
    bf16 = copy.deepcopy(model)
    plan = quantize_model(model)
    layers = model.model.layers
    assert all(isinstance(layer.mlp.experts, NVFP4Experts) for layer in layers)
    assert all(isinstance(layer.self_attn.q_proj, NVFP4Linear) for layer in layers)
    assert not any(p.ndim == 3 and p.dtype in (torch.float32, torch.bfloat16) for p in model.parameters())
    assert set(plan.kept) == {"lm_head"}
    assert model.config.quantization_config["ignore"] == ["lm_head", "re:.*mlp.gate$"]
    # the 16-bit model holding every quantized weight's dequantized value computes the same logits
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, NVFP4Linear):
                bf16.get_submodule(name).weight.copy_(module.dequantize(torch.float32))
            elif isinstance(module, NVFP4Experts):
                ref = dense_reference(module, bf16.get_submodule(name))
                parent, _, child = name.rpartition(".")
                setattr(bf16.get_submodule(parent), child, ref)
    ids = torch.arange(5, 30)[None]
    out = model(ids, labels=ids)
    with torch.no_grad():
        want = bf16(ids).logits
    torch.testing.assert_close(out.logits.detach(), want, rtol=1e-4, atol=1e-5)
    out.loss.backward()
    router = layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0, "the router learns through the FP4 experts"
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in model.named_parameters() if "packed" in n or "scale" in n)


def test_a_quantized_moe_checkpoint_has_the_per_expert_layout_vllm_reads_and_loads_back(tmp_path):
    """``save_pretrained`` after ``quantize_model`` writes what ``random_models.write_nvfp4_checkpoint`` writes for
    the same config (the layout ``test_random_models`` checks against vLLM's expert mapping): the same tensor names,
    dtypes and shapes and the same ``quantization_config``."""
    model = tiny_moe(dtype=torch.bfloat16)
    quantize_model(model)
    model.save_pretrained(tmp_path / "ours")
    config = rm.qwen3_moe_config("qwen3-30b-a3b", **MOE_TINY)
    ref = rm.write_nvfp4_checkpoint(str(tmp_path / "ref"), config)
    a, b = _tensors(str(tmp_path / "ours")), _tensors(ref)
    assert {k: (t.dtype, tuple(t.shape)) for k, t in a.items()} == {k: (t.dtype, tuple(t.shape)) for k, t in b.items()}

    def qc(path):
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)["quantization_config"]

    assert qc(tmp_path / "ours") == qc(ref)
    # the per-expert tensors are the stacks' rows, and load back into a fresh module
    experts = model.model.layers[1].mlp.experts
    assert torch.equal(a["model.layers.1.mlp.experts.2.up_proj.weight_packed"], experts.gate_up_packed[2, 32:])
    assert torch.equal(a["model.layers.1.mlp.experts.2.down_proj.weight_global_scale"],
                       experts.tensors("down")[2][2:3])  # fmt: skip
    fresh = NVFP4Experts(4, 64, 32, experts.act_fn)
    sd = {k.removeprefix("model.layers.1.mlp.experts."): v for k, v in a.items() if ".layers.1.mlp.experts." in k}
    fresh.load_state_dict(sd)
    for name, p in experts.named_parameters():
        assert torch.equal(getattr(fresh, name), p), name
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_state_dict({k: v for k, v in sd.items() if not k.startswith("3.")})


def test_a_moe_is_still_refused_where_its_parts_are_missing():
    """Loading with NVFP4Config quantizes Linears only, and a MoE whose router is not ``mlp.gate`` would be
    written without its router in ``ignore``: both are refused, naming the module."""
    from qerl_trl.quantizer.conversion import plan_conversion

    model = tiny_moe()
    with pytest.raises(MoENotSupportedError, match="holds expert tensors .*the NVFP4 Linear plan cannot convert"):
        plan_conversion(model, None, [])
    mlp = model.model.layers[0].mlp
    mlp.router = mlp.gate
    del mlp.gate
    with pytest.raises(MoENotSupportedError, match=r"model.layers.0.mlp.experts: .*mlp.gate"):
        quantize_model(model)


def test_nvfp4config_quantizer_packs_a_16_bit_moe_checkpoint_on_load_as_quantize_model_does(tmp_path):
    """``from_pretrained(..., quantization_config=NVFP4Config())`` on a 16-bit Qwen3-MoE checkpoint (per-expert
    tensors, as transformers and the Hub save them): transformers merges each layer's experts into its stack, and
    that stack is packed there, one layer at a time: the same bytes as ``quantize_model`` on the loaded model."""
    from transformers import AutoModelForCausalLM

    from qerl_trl import NVFP4Config

    model = tiny_moe(dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", quantization_config=NVFP4Config(),
                                                  dtype=torch.bfloat16)  # fmt: skip
    quantize_model(model)
    assert all(isinstance(layer.mlp.experts, NVFP4Experts) for layer in loaded.model.layers)
    mine, theirs = dict(loaded.named_parameters()), dict(model.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, p in theirs.items():
        assert p.device.type != "meta" and torch.equal(mine[name].view(torch.uint8), p.view(torch.uint8)), name
    assert loaded.config.quantization_config == model.config.quantization_config
    loaded.save_pretrained(tmp_path / "nvfp4")
    from qerl_trl import load_nvfp4

    # and the NVFP4A16 checkpoint it saved loads back packed, the same tensors and the same logits
    back = load_nvfp4(tmp_path / "nvfp4", dtype=torch.bfloat16)
    assert all(isinstance(layer.mlp.experts, NVFP4Experts) for layer in back.model.layers)
    again = dict(back.named_parameters())
    assert again.keys() == theirs.keys()
    for name, p in theirs.items():
        assert torch.equal(again[name].view(torch.uint8), p.view(torch.uint8)), name
    ids = torch.arange(5, 30)[None]
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, loaded(ids).logits)
    # a checkpoint lacking one expert's tensors is refused (transformers alone would initialize them and go on)
    from safetensors.torch import load_file, save_file

    file = tmp_path / "nvfp4" / "model.safetensors"
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if ".layers.1.mlp.experts.2.down_proj." not in k}, file,
              metadata={"format": "pt"})  # fmt: skip
    # (transformers after 5.17 refuses the short stack itself; 5.17 would load it, and the quantizer refuses it)
    with pytest.raises((ValueError, RuntimeError), match=r"experts.down_packed'.*incomplete|mismatched_sizes"):
        load_nvfp4(tmp_path / "nvfp4")


@pytest.mark.gpu
def test_gpu_grouped_experts_match_the_per_expert_loop_at_a_qwen3_30b_a3b_width(monkeypatch):
    """On the GPU: the grouped GEMM over the Triton-dequantized stack against the per-expert NVFP4 matmuls, at
    Qwen3-30B-A3B's expert shapes (hidden 2048, width 768; 16 of its 128 experts), top-8 of 512 tokens."""
    from qerl_trl.nvfp4 import experts as ex

    torch.manual_seed(0)
    experts = types.SimpleNamespace(gate_up_proj=torch.randn(16, 1536, 2048, device="cuda") * 0.02,
                                    down_proj=torch.randn(16, 2048, 768, device="cuda") * 0.02,
                                    act_fn=nn.functional.silu)  # fmt: skip
    packed = NVFP4Experts.from_experts(experts)
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    idx = torch.rand(512, 16, device="cuda").topk(8, dim=-1).indices
    w = torch.rand(512, 8, device="cuda").softmax(-1).to(torch.bfloat16)
    grad = torch.randn_like(x)
    assert ex.grouped_mm_usable(x)

    grouped = expert_pass(packed, x, idx, w, grad, monkeypatch)
    for a, b in zip(grouped, expert_pass(packed, x, idx, w, grad, monkeypatch, grouped=False)):
        assert_near(a, b)
