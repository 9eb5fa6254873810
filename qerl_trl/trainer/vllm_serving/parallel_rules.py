"""The model shapes a tensor-parallel vLLM engine can shard, checked from the model's config before any weight loads.

vLLM 0.24 shards attention heads, KV heads and the MLP width evenly over the tensor-parallel ranks, and refuses a
model that does not split when it builds the engine: in colocate mode that is after the trainer has loaded (and
perhaps quantized) the whole model, minutes at 32B. SmolLM2-135M (9 heads) cannot run at
``vllm_tensor_parallel_size=2``: found on 2 GPUs (issue #39). The NVFP4 scales add one rule of their own: a
row-parallel layer's input is split across ranks, and each shard must hold whole 16-weight scale groups.

The rules are vLLM 0.24's (``ModelConfig.verify_with_parallel_config`` for the heads, ``QKVParallelLinear`` for the
KV heads, ``divide`` for the MLP width), restated here so the check needs no vLLM import.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_tensor_parallel_layout", "tensor_parallel_sizes_for"]

#: weights per FP8 scale in NVFP4: a row-parallel shard's input width must be a multiple of it
NVFP4_GROUP = 16


def _shape(config: Any) -> tuple[int, int, int, int]:
    cfg = getattr(config, "text_config", None) or config
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return heads, kv, head_dim, int(cfg.intermediate_size)


def _layout_problems(config: Any, tp: int) -> list[str]:
    heads, kv, head_dim, inter = _shape(config)
    problems = []
    if heads % tp:
        problems.append(f"its {heads} attention heads do not split over {tp} ranks")
    if (kv % tp) if kv >= tp else (tp % kv):
        problems.append(f"its {kv} KV heads neither split over {tp} ranks nor replicate evenly onto them")
    if inter % tp:
        problems.append(f"its MLP width ({inter}) does not split over {tp} ranks")
    elif (inter // tp) % NVFP4_GROUP:
        problems.append(f"each rank's share of the MLP width ({inter // tp}) is not a whole number of NVFP4 scale "
                        f"groups of {NVFP4_GROUP}")  # fmt: skip
    elif not heads % tp and (heads // tp * head_dim) % NVFP4_GROUP:
        problems.append(f"each rank's share of o_proj's input ({heads // tp * head_dim}) is not a whole number of "
                        f"NVFP4 scale groups of {NVFP4_GROUP}")  # fmt: skip
    return problems


def tensor_parallel_sizes_for(config: Any, up_to: int = 8) -> list[int]:
    """The tensor-parallel sizes up to ``up_to`` that this model's shapes allow (1 always)."""
    return [tp for tp in range(1, up_to + 1) if not _layout_problems(config, tp)]


def check_tensor_parallel_layout(config: Any, tensor_parallel_size: int, world_size: int | None = None,
                                 option: str = "vllm_tensor_parallel_size") -> None:  # fmt: skip
    """Raise a clear error, before any weight loads, when vLLM cannot shard this model over ``tensor_parallel_size``
    ranks, or (colocate mode: ``world_size`` given) when the size does not divide the number of processes, each
    group of that many ranks sharing one engine. ``option``: the setting's name as the user wrote it."""
    tp = int(tensor_parallel_size)
    if tp < 1:
        raise ValueError(f"{option} must be at least 1, got {tp}.")
    if world_size is not None and world_size % tp:
        raise ValueError(
            f"{option}={tp} must divide the number of training processes ({world_size}): each group of {tp} ranks "
            f"shares one vLLM engine. Launch with `accelerate launch --num_processes N` for N a multiple of {tp}, "
            f"or set {option} to a divisor of {world_size}."
        )
    if tp == 1:
        return
    problems = _layout_problems(config, tp)
    if problems:
        name = getattr(config, "_name_or_path", None) or type(config).__name__
        allowed = ", ".join(map(str, tensor_parallel_sizes_for(config)))
        instead = "" if world_size is None else (
            f", or train on several GPUs with {option}=1 (one engine per rank, `accelerate launch --num_processes N`)")
        raise ValueError(
            f"vLLM cannot shard {name} over {option}={tp}: " + "; ".join(problems) + ". "
            f"Sizes this model allows (up to 8): {allowed}. Use one of them{instead}."
        )
