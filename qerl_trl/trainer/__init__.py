"""QeRL's GRPO trainer: `QeRLGRPOConfig` / `QeRLGRPOTrainer` (vLLM internals live in `vllm_serving`, imported lazily)."""

from .config import QeRLGRPOConfig
from .grpo_trainer import QeRLGRPOTrainer
from .policy import SUPPORTED_ARCHITECTURES

__all__ = ["QeRLGRPOConfig", "QeRLGRPOTrainer", "SUPPORTED_ARCHITECTURES"]
