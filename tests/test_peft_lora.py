"""PEFT LoRA on NVFP4Linear: dispatch, all-linear, equivalence with LoRA on the dense dequantized model,
gradient checkpointing, save/load, merge refusal, disable/unload, and transformers' Trainer."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

import qerl_trl  # noqa: F401  (registers the LoRA layer with PEFT)
from qerl_trl.nvfp4 import NVFP4Linear
from qerl_trl.peft_lora import NVFP4LoraLinear, NVFP4MergeError

from conftest import tiny_model

TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def to_nvfp4(model: nn.Module) -> nn.Module:
    """Replace every decoder Linear (not lm_head) by NVFP4Linear, as the quantizer's loader does."""
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(parent, name, NVFP4Linear.from_linear(child, name=f"{parent_name}.{name}.weight"))
    return model


def to_dense(model: nn.Module) -> nn.Module:
    """The same model with each NVFP4Linear replaced by an nn.Linear holding its dequantized weight."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, NVFP4Linear):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                lin = lin.to(child.compute_dtype)
                with torch.no_grad():
                    lin.weight.copy_(child.dequantize(child.compute_dtype))
                    if child.bias is not None:
                        lin.bias.copy_(child.bias)
                lin.requires_grad_(False)
                setattr(parent, name, lin)
    return model


def nvfp4_model(arch="qwen2", dtype=torch.float32, seed=0):
    return to_nvfp4(tiny_model(arch, dtype=dtype, seed=seed))


def lora(**kw):
    kw.setdefault("target_modules", "all-linear")
    kw.setdefault("r", 8)
    kw.setdefault("lora_alpha", 16)
    kw.setdefault("init_lora_weights", "gaussian")  # B = 0 initially; we randomise it below to test grads
    return LoraConfig(**kw)


def randomise_lora(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def lora_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, NVFP4LoraLinear)}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_all_linear_wraps_every_nvfp4linear_but_not_lm_head(arch):
    model = nvfp4_model(arch)
    n_nvfp4 = sum(isinstance(m, NVFP4Linear) for m in model.modules())
    peft_model = get_peft_model(model, lora())
    layers = lora_layers(peft_model)
    assert len(layers) == n_nvfp4 == 2 * len(TARGETS)
    assert {n.rsplit(".", 1)[-1] for n in layers} == TARGETS
    assert all(isinstance(m.base_layer, NVFP4Linear) for m in layers.values())
    assert type(peft_model.base_model.model.lm_head) is nn.Linear  # excluded, like PEFT does for lm_head
    assert set(peft_model.peft_config["default"].target_modules) == {
        n.removeprefix("base_model.model.") for n in layers
    }


def test_explicit_target_list_and_plain_linear_untouched():
    model = tiny_model("qwen2", dtype=torch.float32)
    # only attention is NVFP4; the MLP stays nn.Linear and must get PEFT's ordinary lora.Linear
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, name, NVFP4Linear.from_linear(getattr(layer.self_attn, name)))
    peft_model = get_peft_model(model, lora(target_modules=["q_proj", "v_proj", "up_proj"]))
    from peft.tuners.lora.layer import Linear as PeftLinear

    for layer in peft_model.base_model.model.model.layers:
        assert isinstance(layer.self_attn.q_proj, NVFP4LoraLinear)
        assert isinstance(layer.self_attn.v_proj, NVFP4LoraLinear)
        assert isinstance(layer.self_attn.k_proj, NVFP4Linear)
        assert type(layer.mlp.up_proj) is PeftLinear


def test_only_lora_params_get_grads_and_match_dense_lora():
    base = nvfp4_model("qwen2", dtype=torch.float32)
    dense = to_dense(copy.deepcopy(base))
    pq = get_peft_model(base, lora())
    pd = get_peft_model(dense, lora())
    randomise_lora(pq)
    randomise_lora(pd)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    out_q = pq(input_ids=ids, labels=ids)
    out_d = pd(input_ids=ids, labels=ids)
    torch.testing.assert_close(out_q.logits, out_d.logits, rtol=1e-5, atol=1e-5)
    out_q.loss.backward()
    out_d.loss.backward()
    grads_q = {n: p.grad for n, p in pq.named_parameters() if p.grad is not None}
    grads_d = {n: p.grad for n, p in pd.named_parameters() if p.grad is not None}
    trainable = {n for n, p in pq.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert set(grads_q) == trainable
    assert set(grads_q) == set(grads_d)
    for n in grads_q:
        torch.testing.assert_close(grads_q[n], grads_d[n], rtol=1e-4, atol=1e-6, msg=n)
    assert any(g.abs().sum() > 0 for n, g in grads_q.items() if "lora_A" in n)


def test_lora_weights_are_bf16_by_default_on_a_bf16_base():
    pm = get_peft_model(nvfp4_model(dtype=torch.bfloat16), lora())  # PEFT's default autocast_adapter_dtype=True
    dtypes = {p.dtype for n, p in pm.named_parameters() if p.requires_grad}
    assert dtypes == {torch.bfloat16}
    # PEFT's upcast still applies to ordinary layers (importing qerl_trl changes nothing for them)
    plain = get_peft_model(tiny_model("qwen2", dtype=torch.bfloat16), lora())
    assert {p.dtype for p in plain.parameters() if p.requires_grad} == {torch.float32}


def test_bf16_training_step_runs_and_updates_lora():
    pm = get_peft_model(nvfp4_model(dtype=torch.bfloat16), lora(init_lora_weights=True))
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 256, (2, 10))
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    loss = pm(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    changed = {n for n, p in pm.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_B" in n for n in changed)


def test_gradient_checkpointing_gives_same_grads():
    base = nvfp4_model("qwen2", dtype=torch.float32)
    ref = get_peft_model(copy.deepcopy(base), lora())
    ck = get_peft_model(base, lora())
    randomise_lora(ref)
    randomise_lora(ck)
    ck.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ck.enable_input_require_grads()
    ck.train()
    ref.train()
    ids = torch.randint(0, 256, (2, 9))
    ck(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    n_checked = 0
    for (n, p), (_, q) in zip(ck.named_parameters(), ref.named_parameters()):
        if p.requires_grad:
            assert p.grad is not None, n
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)
            n_checked += 1
    assert n_checked == 2 * 2 * len(TARGETS)


def test_adapter_save_and_load_gives_identical_outputs(tmp_path):
    pm = get_peft_model(nvfp4_model(seed=3), lora())
    randomise_lora(pm, seed=7)
    pm.eval()
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        expected = pm(input_ids=ids).logits
    pm.save_pretrained(tmp_path / "adapter")
    saved = set((tmp_path / "adapter").iterdir())
    assert tmp_path / "adapter" / "adapter_model.safetensors" in saved
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors").keys()
    assert keys and all("lora_A" in k or "lora_B" in k for k in keys)  # the FP4 base is not in the adapter

    loaded = PeftModel.from_pretrained(nvfp4_model(seed=3), tmp_path / "adapter")
    assert len(lora_layers(loaded)) == 2 * len(TARGETS)
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, expected)
    trainable = PeftModel.from_pretrained(nvfp4_model(seed=3), tmp_path / "adapter", is_trainable=True)
    assert any(p.requires_grad for p in trainable.parameters())


def test_merge_is_refused_with_a_clear_error_and_model_stays_usable():
    pm = get_peft_model(nvfp4_model(seed=4), lora())
    randomise_lora(pm)
    pm.eval()
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        before = pm(input_ids=ids).logits
    with pytest.raises(NVFP4MergeError, match="requantizing"):
        pm.merge_and_unload()
    with pytest.raises(NVFP4MergeError, match="16-bit checkpoint"):
        pm.merge_adapter()
    layer = next(iter(lora_layers(pm).values()))
    assert not layer.merged
    with pytest.warns(UserWarning, match="Already unmerged"):
        layer.unmerge()
    with torch.no_grad():
        assert torch.equal(pm(input_ids=ids).logits, before)


def test_disable_adapter_and_unload_give_the_base_model():
    base = nvfp4_model(seed=5)
    base_copy = copy.deepcopy(base).eval()
    pm = get_peft_model(base, lora())
    randomise_lora(pm)
    pm.eval()
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        ref = base_copy(input_ids=ids).logits
        with_lora = pm(input_ids=ids).logits
        with pm.disable_adapter():
            disabled = pm(input_ids=ids).logits
        again = pm(input_ids=ids).logits
    assert not torch.allclose(with_lora, ref)
    assert torch.equal(disabled, ref)
    assert torch.equal(again, with_lora)
    unloaded = pm.unload()
    assert not lora_layers(unloaded)
    assert sum(isinstance(m, NVFP4Linear) for m in unloaded.modules()) == 2 * len(TARGETS)
    with torch.no_grad():
        assert torch.equal(unloaded(input_ids=ids).logits, ref)


def test_unsupported_lora_options_raise():
    with pytest.raises(ValueError, match="plain LoRA only.*use_dora"):
        get_peft_model(nvfp4_model(), lora(use_dora=True))
    with pytest.raises(ValueError, match="pissa.*dense base weight"):
        get_peft_model(nvfp4_model(), lora(init_lora_weights="pissa"))


def _mark_quantized(model):
    """What transformers + our HfQuantizer set on a model loaded with NVFP4Config (preprocess_model)."""
    from qerl_trl.quantizer import NVFP4Config
    from qerl_trl.quantizer.hf_quantizer import NVFP4HfQuantizer

    model.hf_quantizer = NVFP4HfQuantizer(NVFP4Config())
    model.is_quantized = True
    model.quantization_method = model.hf_quantizer.quantization_config.quant_method
    return model


def test_trainer_accepts_nvfp4_lora_model_and_trains(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0)).tolist()
    ds = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    # Trainer refuses a quantized model without adapters...
    with pytest.raises(ValueError, match="purely quantized"):
        Trainer(model=_mark_quantized(nvfp4_model(dtype=torch.bfloat16)), args=args, train_dataset=ds)
    # ...and accepts it with LoRA on top
    pm = get_peft_model(_mark_quantized(nvfp4_model(dtype=torch.bfloat16)), lora(init_lora_weights=True))
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    trainer = Trainer(model=pm, args=args, train_dataset=ds)
    result = trainer.train()
    assert result.global_step == 2
    changed = {n for n, p in pm.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert all(isinstance(m, NVFP4Linear) for m in pm.modules() if isinstance(m, NVFP4Linear))
