"""``vllm_tensor_parallel_size`` against the model's shapes, refused before any weight loads (issue #39: vLLM refused
SmolLM2-135M at TP=2 only once the engine started, after the trainer had loaded and quantized the model)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from benchmarks import random_models as rm
from qerl_trl.trainer.vllm_serving.parallel_rules import check_tensor_parallel_layout, tensor_parallel_sizes_for


def smollm2_135m_config() -> LlamaConfig:
    """SmolLM2-135M-Instruct's shapes (its GGUF's): 9 attention heads, 3 KV heads, MLP width 1536."""
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, architectures=["LlamaForCausalLM"])  # fmt: skip


@pytest.mark.parametrize(
    "size,allowed",
    [("qwen2.5-7b", [1, 2, 4]), ("qwen2.5-14b", [1, 2, 4, 8]), ("qwen2.5-32b", [1, 2, 4, 8])],
)
def test_the_sizes_users_train_shard_as_vllm_allows(size, allowed):
    # 7B: 28 heads (not over 8); 14B: 40 heads, 8 KV heads; 32B: 40 heads, 8 KV heads, MLP 27648
    assert tensor_parallel_sizes_for(rm.qwen25_config(size)) == allowed


def test_smollm2_is_refused_at_tp2_naming_the_heads_and_the_sizes_it_allows():
    with pytest.raises(ValueError) as err:
        check_tensor_parallel_layout(smollm2_135m_config(), 2, world_size=2)
    msg = str(err.value)
    assert "9 attention heads do not split over 2 ranks" in msg and "3 KV heads" in msg
    assert "Sizes this model allows (up to 8): 1, 3. Use one of them, or train" in msg
    assert "vllm_tensor_parallel_size=1 (one engine per rank" in msg


def test_kv_heads_replicate_only_evenly_and_fp4_groups_stay_whole():
    # 8 heads, 2 KV heads at TP=4: each KV head on 2 ranks (vLLM replicates); at TP=8: on 4 ranks
    cfg = rm.qwen25_config("qwen2.5-1.5b", num_attention_heads=8, num_key_value_heads=2, hidden_size=512,
                           intermediate_size=1024)  # fmt: skip
    check_tensor_parallel_layout(cfg, 4)
    check_tensor_parallel_layout(cfg, 8)
    cfg = rm.qwen25_config("qwen2.5-1.5b", num_attention_heads=24, num_key_value_heads=3)  # 24 heads split over 8
    with pytest.raises(ValueError, match="3 KV heads neither split over 8 ranks nor replicate evenly"):
        check_tensor_parallel_layout(cfg, 8)
    odd = rm.qwen25_config("qwen2.5-1.5b", intermediate_size=8960 + 16)  # 8976 / 2 = 4488: not whole groups of 16
    with pytest.raises(ValueError, match=r"MLP width \(4488\) is not a whole number of NVFP4 scale groups"):
        check_tensor_parallel_layout(odd, 2)


def test_the_size_must_divide_the_number_of_processes():
    cfg = rm.qwen25_config("qwen2.5-14b")
    check_tensor_parallel_layout(cfg, 2, world_size=4)
    with pytest.raises(ValueError, match=r"vllm_tensor_parallel_size=2 must divide the number of training processes "
                                         r"\(3\).*--num_processes N"):  # fmt: skip
        check_tensor_parallel_layout(cfg, 2, world_size=3)
    with pytest.raises(ValueError, match="at least 1"):
        check_tensor_parallel_layout(cfg, 0)


def test_the_gpu_tests_tp2_model_passes_the_check():
    """The TP=2 GPU test (``test_tensor_parallel_gpu.py``) runs a model this check lets through, unlike its first
    version."""
    from test_tensor_parallel_gpu import tensor_parallel_config

    check_tensor_parallel_layout(tensor_parallel_config(), 2, world_size=2)


def test_the_trainer_refuses_before_loading_any_weight(tmp_path, monkeypatch):
    """A checkpoint with a config and no weights: the refusal must come from the config alone."""
    from qerl_trl import QeRLGRPOConfig, QeRLGRPOTrainer
    from qerl_trl.trainer import vllm_serving

    smollm2_135m_config().save_pretrained(tmp_path)  # config.json only: loading weights would fail differently
    monkeypatch.setattr(vllm_serving, "require_vllm", lambda: None)  # the CPU venv has no vLLM; the check needs none
    args = QeRLGRPOConfig(output_dir=str(tmp_path / "out"), use_vllm=True, vllm_tensor_parallel_size=2, use_cpu=True,
                          report_to="none")  # fmt: skip
    def reward(completions, **kw):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"must divide the number of training processes \(1\)"):  # one process
        QeRLGRPOTrainer(model=str(tmp_path), reward_funcs=reward, args=args)
    monkeypatch.setattr(QeRLGRPOConfig, "world_size", property(lambda self: 2))  # as under accelerate launch x2
    with pytest.raises(ValueError, match="cannot shard .* over vllm_tensor_parallel_size=2: its 9 attention heads"):
        QeRLGRPOTrainer(model=str(tmp_path), reward_funcs=reward, args=args)


def test_vllm_serve_refuses_a_tensor_parallel_size_the_model_cannot_take(tmp_path):
    from qerl_trl.quantizer import quantize_checkpoint
    from qerl_trl.trainer.vllm_serving.server_command import vllm_serve_command
    from test_examples import tiny_checkpoint

    nvfp4 = quantize_checkpoint(str(tiny_checkpoint(tmp_path / "bf16")), tmp_path / "nvfp4")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"over --tensor-parallel-size=3: its 4 attention heads.*allows "
                                         r"\(up to 8\): 1, 2, 4\. Use one of them\.$"):  # fmt: skip
        vllm_serve_command(str(nvfp4), fp4_kernel="marlin", tensor_parallel_size=3)
