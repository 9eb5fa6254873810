"""find_noise_targets: norms found by data flow (plain, NVFP4, LoRA-wrapped, PeftModel); clear errors otherwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import TINY_ARCHS, tiny_config, tiny_model
from qerl_trl.aqn import AQNStructureError, find_noise_targets, vllm_param_name
from qerl_trl.nvfp4 import NVFP4Linear, compute_global_scale

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def to_nvfp4(model: nn.Module) -> nn.Module:
    """Swap every decoder projection for NVFP4Linear (q/k/v and gate/up share a global scale, as in vLLM)."""
    for layer in model.model.layers:
        for parent, group in ((layer.self_attn, QKV), (layer.mlp, GATE_UP)):
            gs = compute_global_scale(*(getattr(parent, n).weight for n in group))
            for n in group:
                setattr(parent, n, NVFP4Linear.from_linear(getattr(parent, n), global_scale=gs))
        layer.self_attn.o_proj = NVFP4Linear.from_linear(layer.self_attn.o_proj)
        layer.mlp.down_proj = NVFP4Linear.from_linear(layer.mlp.down_proj)
    return model


def expected(n_layers: int, prefix: str = "") -> list[tuple[str, int, tuple[str, ...]]]:
    out = []
    for i in range(n_layers):
        out.append((f"{prefix}model.layers.{i}.input_layernorm.weight", i, QKV))
        out.append((f"{prefix}model.layers.{i}.post_attention_layernorm.weight", i, GATE_UP))
    return out


def summary(targets):
    return [(t.name, t.layer_index, t.feeds) for t in targets]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_targets_per_architecture(arch):
    model = tiny_model(arch, num_hidden_layers=3)
    targets = find_noise_targets(model)
    assert summary(targets) == expected(3)
    params = dict(model.named_parameters())
    for t in targets:
        assert params[t.name] is t.module.weight
        assert vllm_param_name(t) == t.name
    names = {t.name for t in targets}
    assert "model.norm.weight" not in names  # the final norm feeds lm_head, outside the layers
    assert not any("q_norm" in n or "k_norm" in n for n in names)  # Qwen3's head-dim norms


def test_targets_with_nvfp4_projections():
    model = to_nvfp4(tiny_model("qwen2"))
    assert isinstance(model.model.layers[0].self_attn.q_proj, NVFP4Linear)
    assert summary(find_noise_targets(model)) == expected(2)


def test_the_trace_never_computes_a_projection(monkeypatch):
    """The trainer traces the model while it is still on the CPU, where a 14B NVFP4 forward took 155 s: the
    projections return zeros of their shape instead, and every module's own forward is back afterwards."""
    model = to_nvfp4(tiny_model("qwen2"))

    def refuse(*args, **kwargs):
        raise AssertionError("a projection computed during the trace")

    monkeypatch.setattr(NVFP4Linear, "forward", refuse)
    monkeypatch.setattr(nn.Linear, "forward", refuse)
    assert summary(find_noise_targets(model)) == expected(2)
    assert not any("forward" in vars(m) for m in model.modules())
    monkeypatch.undo()
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.abs().sum() > 0


def test_a_model_that_needs_its_projections_values_is_traced_with_them():
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    real_forward = type(attn).forward

    def forward(self, hidden_states, *args, **kwargs):
        if not self.q_proj(hidden_states).any():  # a data-dependent check that zeros from the stubs would fail
            raise RuntimeError("q_proj returned zeros")
        return real_forward(self, hidden_states, *args, **kwargs)

    attn.forward = forward.__get__(attn)
    assert summary(find_noise_targets(model)) == expected(2)


def test_discovery_leaves_training_mode_alone():
    model = tiny_model("llama").train()
    model.model.layers[1].eval()
    find_noise_targets(model)
    assert model.training and model.model.layers[0].training and not model.model.layers[1].training


def _lora(model, *, custom_nvfp4: bool = False):
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import Linear as LoraLinear

    cfg = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    if custom_nvfp4:
        # PEFT's generic LoRA Linear over an NVFP4Linear base (base_layer(x) + B(A(x))): enough for the data flow.
        cfg._register_custom_module({NVFP4Linear: LoraLinear})
    return get_peft_model(model, cfg)


def test_targets_through_peft_model():
    base = tiny_model("llama")
    clean = summary(find_noise_targets(base))
    peft_model = _lora(base)
    targets = find_noise_targets(peft_model)
    assert summary(targets) == expected(2, prefix="base_model.model.")
    assert [vllm_param_name(t) for t in targets] == [n for n, _, _ in clean]
    params = dict(peft_model.named_parameters())
    for t in targets:
        assert params[t.name] is t.module.weight
    assert type(peft_model.base_model.model.model.layers[0].self_attn.q_proj).__name__ == "Linear"
    assert hasattr(peft_model.base_model.model.model.layers[0].self_attn.q_proj, "lora_A")


def test_targets_through_peft_lora_on_nvfp4():
    peft_model = _lora(to_nvfp4(tiny_model("qwen3")), custom_nvfp4=True)
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q.base_layer, NVFP4Linear) and hasattr(q, "lora_A")
    assert summary(find_noise_targets(peft_model)) == expected(2, prefix="base_model.model.")


def test_vllm_param_name_strips_wrappers():
    n = "model.layers.3.input_layernorm.weight"
    for wrapped in (n, "base_model.model." + n, "module.base_model.model." + n, "_orig_mod." + n,
                    "model.layers.3._checkpoint_wrapped_module.input_layernorm.weight"):
        assert vllm_param_name(wrapped) == n
        assert vllm_param_name(vllm_param_name(wrapped)) == n


def test_error_without_rmsnorm_like_layers():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
    gpt2 = AutoModelForCausalLM.from_config(cfg)  # LayerNorm with bias, Conv1D projections
    with pytest.raises(AQNStructureError, match=r"found no decoder layers in GPT2LMHeadModel.*hidden=64"):
        find_noise_targets(gpt2)


class _Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm = nn.RMSNorm(h)
        self.proj = nn.Linear(h, h)

    def forward(self, x):
        return x + self.proj(torch.tanh(self.norm(x)))  # the norm's output never reaches a projection directly


class _Toy(nn.Module):
    def __init__(self, h=32):
        super().__init__()
        self.config = tiny_config("llama", hidden_size=h)
        self.embed = nn.Embedding(16, h)
        self.layers = nn.ModuleList(_Block(h) for _ in range(2))

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x


def test_error_lists_what_was_found():
    with pytest.raises(AQNStructureError) as e:
        find_noise_targets(_Toy())
    msg = str(e.value)
    assert "no norm-like module in any layer list feeds a Linear-like projection" in msg
    assert "layers.0.norm -> no projection" in msg and "layers[1]" in msg


def test_error_when_some_layer_lacks_structure():
    model = tiny_model("llama", num_hidden_layers=3)
    model.model.layers[1].input_layernorm = nn.LayerNorm(64)  # has a bias: not RMSNorm-like, q/k/v get no norm
    with pytest.raises(AQNStructureError, match=r"layers \[1\] of model.layers have fewer norms") as e:
        find_noise_targets(model)
    msg = str(e.value)
    assert "model.layers[0]: model.layers.0.input_layernorm -> ['q_proj', 'k_proj', 'v_proj']" in msg
    assert "model.layers[1]: model.layers.1.post_attention_layernorm -> ['gate_proj', 'up_proj']" in msg


@pytest.mark.parametrize("lora_targets", [["q_proj"], ["q_proj", "experts"]])
def test_a_moe_gets_noise_in_both_norms_on_the_base_and_under_any_lora(lora_targets):
    """The post-attention norm feeds the packed NVFP4 experts (FP4 projections of the hidden state, as gate/up are):
    a target on the base model, where the trainer lists vLLM's float32 norms, and under PEFT, where AQN noises them,
    with or without a LoRA on the experts. They differed before (the base model's trace saw no projection after the
    norm, PEFT's expert LoRA did): vLLM then held a noised norm in bf16 (the GPU suite's moe part at a05a113)."""
    from peft import LoraConfig, get_peft_model

    import qerl_trl.peft_lora  # noqa: F401 - registers the NVFP4 LoRA layers
    from qerl_trl.quantizer import NVFP4Config, quantize_model
    from tests.test_nvfp4_experts import tiny_moe

    model = tiny_moe(dtype=torch.bfloat16)
    quantize_model(model, NVFP4Config())
    want = [(f"model.layers.{i}.{norm}.weight", i, feeds) for i in range(2)
            for norm, feeds in (("input_layernorm", QKV), ("post_attention_layernorm", ("experts",)))]  # fmt: skip
    assert summary(find_noise_targets(model)) == want
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=lora_targets)
    peft_model = get_peft_model(model, lora)
    assert [vllm_param_name(t) for t in find_noise_targets(peft_model)] == [n for n, _, _ in want]
