"""The engine's FP4 kernel choice (``QeRLGRPOConfig.vllm_fp4_kernel``): Humming or Marlin, per GPU, install and
layer shape, and what each LoRA backend asks vLLM for. CPU only: no vLLM or Humming needed."""

from __future__ import annotations

import json

import pytest

from qerl_trl.vllm_plugin.fp4_kernel import choose_fp4_kernel, decoder_linear_shapes, humming_shape_problem

QWEN7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4}
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}
HOPPER, ADA = (9, 0), (8, 9)


def choose(requested="auto", per_layer=True, config=QWEN7B, capability=HOPPER, version="0.1.19", **kw):
    return choose_fp4_kernel(requested, per_layer=per_layer, model_config=config, capability=capability,
                             humming_version=version, **kw)  # fmt: skip


def test_shape_rule_and_per_shard_shapes():
    assert humming_shape_problem([3584, 512, 512], 3584) is None
    assert "192" in humming_shape_problem([512, 192, 192], 512)
    assert "input size 96" in humming_shape_problem(256, 96)
    shapes = decoder_linear_shapes(QWEN7B, tp_size=2)
    assert shapes["q_proj"] == (1792, 3584) and shapes["k_proj"] == (256, 3584) and shapes["down_proj"] == (3584, 9472)
    assert decoder_linear_shapes(QWEN7B, tp_size=8)["k_proj"] == (128, 3584)  # 4 KV heads replicated over 8 ranks


def test_auto_picks_humming_on_hopper_only_where_installed():
    assert choose().kernel == "humming" and "0.1.19" in choose().reason
    for kw, why in [(dict(capability=ADA), "sm_89"), (dict(capability=None), "no CUDA GPU"),
                    (dict(version=None), "not installed")]:  # fmt: skip
        got = choose(**kw)
        assert got.kernel == "marlin" and why in got.reason, got
    assert choose("marlin").kernel == "marlin"


def test_a_misfit_layer_goes_to_marlin_per_layer_or_sends_the_whole_model_there():
    per_layer = choose(config=SMOLLM2)
    assert per_layer.kernel == "humming"
    # q is 576 rows: q/k/v (one packed layer) and o and down (576 out) stay on Marlin; gate/up (1536 x 576) fit
    assert set(per_layer.marlin_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "down_proj"}
    whole = choose(config=SMOLLM2, per_layer=False)
    assert whole.kernel == "marlin" and "vllm_lora_backend='vllm'" in whole.reason
    # a module the checkpoint did not quantize does not count
    assert choose(config=SMOLLM2, quantized_modules=["gate_proj", "up_proj"]).marlin_modules == ()


def test_forcing_humming_fails_early_with_what_to_do():
    with pytest.raises(ImportError, match="humming-kernels.*pip install"):
        choose("humming", version=None)
    with pytest.raises(ValueError, match="vllm_lora_backend='qerl'"):
        choose("humming", per_layer=False, config=SMOLLM2)
    assert choose("humming", capability=ADA).kernel == "humming"  # the user asked for it on another GPU
    with pytest.raises(ValueError, match="vllm_fp4_kernel must be one of"):
        choose("cutlass")


def test_a_moe_model_keeps_its_experts_off_humming_under_either_backend():
    """vLLM 0.24's Humming MoE method cannot load NVFP4A16 experts (the GPU suite's ``moe`` part at 517d8d7): the
    "vllm" backend, which puts the whole model on one kernel, takes Marlin; "qerl" keeps Humming for the attention."""
    from qerl_trl.quantizer.moe import moe_expert_count as expert_count

    moe = dict(QWEN7B, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, head_dim=128)
    assert expert_count(moe) == 128 and expert_count({"text_config": {"num_local_experts": 8}}) == 8
    assert expert_count(QWEN7B) == 0
    whole = choose(config=moe, per_layer=False)
    assert whole.kernel == "marlin" and "mixture-of-experts" in whole.reason and "Humming MoE" in whole.reason
    with pytest.raises(ValueError, match="vllm_lora_backend='qerl'.*Marlin MoE"):
        choose("humming", per_layer=False, config=moe)
    per_layer = choose(config=moe)
    assert per_layer.kernel == "humming" and "experts on vLLM's compressed-tensors MoE method" in per_layer.reason
    assert per_layer.marlin_modules == ()  # the dense MLP shapes of the config are not the model's: not checked
    assert choose("humming", config=moe).kernel == "humming"
    assert choose(config=QWEN7B, per_layer=False).kernel == "humming"  # a dense model as before


def test_the_config_refuses_an_unknown_kernel(tmp_path):
    from qerl_trl import QeRLGRPOConfig

    assert QeRLGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True).vllm_fp4_kernel == "auto"
    with pytest.raises(ValueError, match="vllm_fp4_kernel must be 'auto', 'humming' or 'marlin'"):
        QeRLGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, vllm_fp4_kernel="machete")


def test_each_backend_asks_vllm_for_the_resolved_kernel(tmp_path, caplog, monkeypatch):
    from qerl_trl.trainer.vllm_serving import AdapterLoRABackend, VLLMServingSpec, resolve_fp4_kernel
    from qerl_trl.trainer.vllm_serving import fp4_kernel_choice
    from qerl_trl.vllm_plugin import LORA_KEY, lora_quantization_overrides

    spec = VLLMServingSpec(checkpoint=str(tmp_path), tokenizer=str(tmp_path), max_lora_rank=32, fp4_kernel="humming")
    assert AdapterLoRABackend(spec).engine_kwargs(None)["quantization"] == "humming"
    spec.fp4_kernel = "marlin"
    assert "quantization" not in AdapterLoRABackend(spec).engine_kwargs(None)
    ct = {"quantization_config": {"quant_method": "compressed-tensors"}}
    assert lora_quantization_overrides(ct, 8, ["q_proj"], "humming")["quantization_config"][LORA_KEY]["fp4_kernel"] \
        == "humming"  # fmt: skip
    with pytest.raises(ValueError, match="resolved from 'auto' first"):
        lora_quantization_overrides(ct, 8, ["q_proj"], "auto")

    (tmp_path / "config.json").write_text(json.dumps({**QWEN7B, **ct}))
    monkeypatch.setattr(fp4_kernel_choice, "_gpu_capability", lambda: HOPPER)
    monkeypatch.setattr(fp4_kernel_choice, "installed_humming_version", lambda: "0.1.19")
    monkeypatch.setenv("HUMMING_CACHE_DIR", str(tmp_path / "empty-cache"))
    with caplog.at_level("INFO"):
        got = resolve_fp4_kernel("auto", "qerl", str(tmp_path))
    assert got.kernel == "humming"
    assert "vLLM FP4 kernel: humming" in caplog.text and "first engine start compiles" in caplog.text
    monkeypatch.setattr(fp4_kernel_choice, "installed_humming_version", lambda: None)
    assert resolve_fp4_kernel("auto", "vllm", str(tmp_path)).kernel == "marlin"
    with pytest.raises(ImportError, match="pip install"):
        fp4_kernel_choice.require_humming_if_forced("humming")


def test_humming_compile_ahead_reaches_the_engine_spec_only_on_humming_in_layer_and_is_refused_elsewhere(tmp_path,
                                                                                                        monkeypatch):
    """QeRLGRPOConfig(vllm_humming_compile_ahead=True) puts "humming_ahead" in the in-layer method's spec when the
    engine runs Humming (a new compile-cache key), nothing on Marlin; with vLLM's own LoRA it is refused."""
    from qerl_trl import QeRLGRPOConfig
    from qerl_trl.trainer.vllm_serving import InLayerLoRABackend, VLLMServingSpec
    from qerl_trl.trainer.vllm_serving import in_layer_lora
    from qerl_trl.vllm_plugin import LORA_KEY, lora_quantization_overrides

    common = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert QeRLGRPOConfig(**common).vllm_humming_compile_ahead is None
    assert QeRLGRPOConfig(**common, vllm_humming_compile_ahead=True).vllm_humming_compile_ahead is True
    with pytest.raises(ValueError, match="vllm_humming_compile_ahead=True works in QeRL's in-layer LoRA method"):
        QeRLGRPOConfig(**common, vllm_humming_compile_ahead=True, vllm_lora_backend="vllm")
    # None, the default: on with the in-layer method, off with vLLM's own LoRA (no error); False: off
    from qerl_trl.trainer.config import humming_compile_ahead_enabled

    assert humming_compile_ahead_enabled(QeRLGRPOConfig(**common))
    assert not humming_compile_ahead_enabled(QeRLGRPOConfig(**common, vllm_humming_compile_ahead=False))
    assert not humming_compile_ahead_enabled(QeRLGRPOConfig(**common, vllm_lora_backend="vllm"))
    assert humming_compile_ahead_enabled(QeRLGRPOConfig(**common, vllm_humming_compile_ahead=True))
    assert humming_compile_ahead_enabled(QeRLGRPOConfig(**common, vllm_humming_compile_ahead=None))
    auto_vllm = QeRLGRPOConfig(**common, vllm_humming_compile_ahead=None, vllm_lora_backend="vllm")
    assert not humming_compile_ahead_enabled(auto_vllm)

    ct = {"quantization_config": {"quant_method": "compressed-tensors"}}
    plain = lora_quantization_overrides(ct, 8, ["q_proj"], "humming")["quantization_config"][LORA_KEY]
    ahead = lora_quantization_overrides(ct, 8, ["q_proj"], "humming", humming_ahead=True)
    ahead = ahead["quantization_config"][LORA_KEY]
    assert "humming_ahead" not in plain and ahead == {**plain, "humming_ahead": True}

    asked = []
    monkeypatch.setattr(in_layer_lora, "single_lora_engine_kwargs",
                        lambda ckpt, model, kernel, humming_ahead=False, **kw: asked.append((kernel, humming_ahead)))
    for kernel, on, want in [("humming", True, True), ("marlin", True, False), ("humming", False, False)]:
        spec = VLLMServingSpec(checkpoint=str(tmp_path), tokenizer=str(tmp_path), max_lora_rank=8, fp4_kernel=kernel,
                               humming_ahead=on)  # fmt: skip
        InLayerLoRABackend(spec).engine_kwargs(None)
        assert asked[-1] == (kernel, want)
