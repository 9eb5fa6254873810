"""GPU checks of the NVFP4 foundation (issue 2): quantize-on-load to CUDA, the CUDA NVFP4Linear path, PEFT LoRA
training on CUDA, and a checkpoint round trip. Run on the GPU machine with ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch

import qerl_trl  # noqa: F401  (registers the quantizer and the PEFT dispatcher)
from conftest import tiny_model
from qerl_trl.nvfp4 import NVFP4Linear
from qerl_trl.nvfp4 import format as nvfp4
from qerl_trl.nvfp4.ops import active_backend_name
from qerl_trl.quantizer import NVFP4Config

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_quantize_on_load_to_cuda_matches_cpu(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    dense = tiny_model(arch)
    dense.save_pretrained(tmp_path / "bf16")
    cpu = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", quantization_config=NVFP4Config(), dtype=torch.bfloat16)
    gpu = AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", quantization_config=NVFP4Config(), dtype=torch.bfloat16, device_map="cuda"
    )
    n = 0
    for name, m in gpu.named_modules():
        if isinstance(m, NVFP4Linear):
            c = cpu.get_submodule(name)
            assert m.weight_packed.is_cuda
            assert torch.equal(m.weight_packed.cpu(), c.weight_packed)
            assert torch.equal(m.weight_scale.cpu().view(torch.uint8), c.weight_scale.view(torch.uint8))
            assert torch.equal(m.weight_global_scale.cpu(), c.weight_global_scale)
            n += 1
    assert n == 7 * dense.config.num_hidden_layers
    ids = torch.randint(0, dense.config.vocab_size, (2, 24))
    with torch.no_grad():
        lg = gpu(ids.cuda()).logits.float().cpu()
        lc = cpu(ids).logits.float()
    assert _rel(lg, lc) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 37, 512])
def test_cuda_linear_matches_dense_reference(dtype, m):
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 768, bias=True, dtype=dtype, device="cuda")
    q = NVFP4Linear.from_linear(lin)
    w = q.dequantize(torch.float32)
    x = torch.randn(m, 1024, device="cuda", dtype=dtype, requires_grad=True)
    y = q(x)
    ref = x.float() @ w.t() + q.bias.float()
    assert y.dtype == dtype and _rel(y, ref) < 1e-2
    dy = torch.randn_like(y)
    y.backward(dy)
    assert _rel(x.grad, dy.float() @ w) < 1e-2
    # the fast kernels (when Triton is importable) take these shapes on CUDA
    pytest.importorskip("triton")
    assert active_backend_name(x.detach(), q.weight_packed) == "triton"


def test_peft_lora_trains_on_cuda_and_base_stays_bit_identical(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dense = tiny_model("qwen2")
    dense.save_pretrained(tmp_path / "bf16")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", quantization_config=NVFP4Config(), dtype=torch.bfloat16, device_map="cuda"
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "weight_packed" in n}
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, dense.config.vocab_size, (4, 32), device="cuda")
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    after = {n.replace("base_model.model.", "").replace(".base_layer", ""): p for n, p in model.named_parameters()}
    for n, p in before.items():
        assert torch.equal(after[n], p), n


def test_checkpoint_round_trip_on_cuda(tmp_path):
    from transformers import AutoModelForCausalLM

    dense = tiny_model("qwen3")
    dense.save_pretrained(tmp_path / "bf16")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", quantization_config=NVFP4Config(), dtype=torch.bfloat16, device_map="cuda"
    )
    model.save_pretrained(tmp_path / "nvfp4")
    again = qerl_trl.load_nvfp4(tmp_path / "nvfp4", dtype=torch.bfloat16, device_map="cuda")
    ids = torch.randint(0, dense.config.vocab_size, (1, 16), device="cuda")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_quantize_matches_on_cuda_and_cpu():
    """The format functions give the same bytes on CUDA as on CPU (vLLM checkpoints may be made on either)."""
    torch.manual_seed(1)
    w = torch.randn(96, 256, dtype=torch.bfloat16) * torch.logspace(-3, 1, 256).to(torch.bfloat16)
    qc = nvfp4.quantize(w)
    qg = nvfp4.quantize(w.cuda())
    assert torch.equal(qc.weight_packed, qg.weight_packed.cpu())
    assert torch.equal(qc.weight_scale.view(torch.uint8), qg.weight_scale.cpu().view(torch.uint8))
    assert torch.equal(qc.weight_global_scale, qg.weight_global_scale.cpu())
