"""QeRL's GRPO trainer: `QeRLGRPOConfig` / `QeRLGRPOTrainer` (vLLM internals live in `vllm_serving`, imported lazily)."""

from .config import QeRLGRPOConfig
from .grpo_trainer import SUPPORTED_ARCHITECTURES, QeRLGRPOTrainer

__all__ = ["QeRLGRPOConfig", "QeRLGRPOTrainer", "SUPPORTED_ARCHITECTURES"]
