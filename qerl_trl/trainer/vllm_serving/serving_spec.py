"""What QeRL's colocated vLLM engine serves, as the trainer resolved it from ``QeRLGRPOConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["VLLMServingSpec"]

@dataclass
class VLLMServingSpec:
    """What QeRL's vLLM engine serves: the NVFP4A16 checkpoint, the LoRA rank bound and the fp32 norm names."""

    checkpoint: str
    tokenizer: str
    max_lora_rank: int
    fp32_norm_names: list[str] = field(default_factory=list)
    enforce_eager: bool = False
    lora_sync_dir: str = "/dev/shm"
    lora_sync_in_place: bool = True  # "vllm" backend: later rounds refresh the loaded adapter on the GPU
    dtype: str = "bfloat16"
    lora_backend: str = "qerl"  # "qerl": the LoRA inside our quantization method; "vllm": vLLM's LoRA adapters
    fp4_kernel: str = "marlin"  # resolved from QeRLGRPOConfig.vllm_fp4_kernel: "humming" or "marlin"
    humming_ahead: bool = False  # "qerl" backend on Humming: fewer kernels, compiled ahead
    expand_in_gemm: bool = False  # "qerl" backend on Humming: the LoRA's B inside the FP4 GEMM
    return_routed_experts: bool = False  # MoE: vLLM records each token's experts (trainer.moe_routing)
