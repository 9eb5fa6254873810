"""Which FP4 GEMM vLLM runs the NVFP4A16 base on: Humming or Marlin. Plain functions; imports no vLLM.

Why: vLLM 0.24 serves NVFP4A16 on Hopper with Marlin, an Ampere design whose largest M tile is 64 rows, and at the
batch sizes GRPO decodes (64-128 sequences an engine) it is slower than merged BF16 at 7B and 14B. Humming
(``humming-kernels``, vllm-project/humming) is a Hopper mixed-input GEMM (wgmma fed from registers, TMA, warp
specialization) that vLLM 0.24 runs as ``quantization="humming"`` on the same compressed-tensors checkpoint; on one
H100 it decoded 7B 1.27x / 1.11x merged BF16 at batch 64 / 128 where Marlin gave 0.96x / 0.70x (issue #38).

``"auto"`` takes Humming where it is installed, the GPU is Hopper (compute capability 9.x) and the layer's shape
fits it, and Marlin elsewhere. The trainer logs the choice and its reason once, before the engine starts.

Where the check can be per layer (``vllm_lora_backend="qerl"``: our quantization method picks each linear's
kernel), a layer Humming cannot take runs on Marlin and the others on Humming. With ``"vllm"`` (vLLM's
``quantization="humming"`` serves the whole model) one such layer sends the whole model to Marlin.

A mixture-of-experts model's experts run on vLLM's compressed-tensors MoE method (Marlin MoE on Hopper) under either
backend: vLLM 0.24's Humming MoE method cannot load their NVFP4A16 checkpoint (:data:`HUMMING_MOE_PROBLEM`), so with
``"vllm"`` such a model runs on Marlin, and with ``"qerl"`` its attention linears may still take Humming.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from ..quantizer.moe import MOE_LORA_TARGETS, moe_expert_count

__all__ = [
    "DECODER_LINEARS",
    "FP4_KERNELS",
    "HUMMING_DIST",
    "HUMMING_K_MULTIPLE",
    "HUMMING_N_MULTIPLE",
    "HUMMING_MOE_PROBLEM",
    "FP4KernelChoice",
    "check_humming_for_experts",
    "choose_fp4_kernel",
    "decoder_linear_shapes",
    "humming_cache_dir",
    "humming_missing",
    "humming_shape_problem",
    "installed_humming_version",
]

FP4_KERNELS = ("auto", "humming", "marlin")
#: the leaf names of a dense decoder layer's linears
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HUMMING_DIST = "humming-kernels"
#: Humming's documented shape limits (per tensor-parallel shard): N a multiple of 128, K of 64
HUMMING_N_MULTIPLE = 128
HUMMING_K_MULTIPLE = 64
#: compute capabilities where "auto" picks Humming: Hopper. Humming runs from sm_75, but it was measured against
#: Marlin on Hopper only; Blackwell has native FP4 in vLLM.
HUMMING_AUTO_MAJORS = (9,)
#: found on 4 H200s at 517d8d7 (the GPU suite's ``moe`` part, and ``rollout.py --sizes 30b-a3b --arms nvfp4@humming``)
HUMMING_MOE_PROBLEM = (
    "vLLM 0.24's Humming MoE method cannot load a compressed-tensors NVFP4A16 checkpoint's experts (its weight loader "
    "indexes a per-expert global-scale parameter that has no gate/up axis: IndexError)"
)
EXPERTS_ON_MARLIN = "; the experts on vLLM's compressed-tensors MoE method (Marlin)"


@dataclass(frozen=True)
class FP4KernelChoice:
    """The engine's FP4 kernel and why; ``marlin_modules``: leaf modules left on Marlin by their shape (per layer)."""

    kernel: str  # "humming" or "marlin"
    reason: str
    marlin_modules: tuple[str, ...] = ()

    def log_line(self) -> str:
        line = f"vLLM FP4 kernel: {self.kernel} ({self.reason})"
        if self.kernel == "humming":
            line += (f"; Humming compiles its kernels at the first engine start on a machine (minutes), then loads them "
                     f"from {humming_cache_dir()}")  # fmt: skip
        return line


def installed_humming_version() -> str | None:
    """The installed ``humming-kernels`` version, or None."""
    try:
        return metadata.version(HUMMING_DIST)
    except metadata.PackageNotFoundError:
        return None


def humming_missing() -> ImportError:
    """The error for ``vllm_fp4_kernel='humming'`` without the package (the trainer raises it before any weight loads)."""
    return ImportError(
        f"vllm_fp4_kernel='humming' needs the {HUMMING_DIST} package, which is not installed: "
        "pip install 'qerl-trl[vllm]' (or set vllm_fp4_kernel='auto' to use it where it is installed)."
    )


def humming_cache_dir() -> str:
    """Where Humming keeps its compiled kernels (``$HUMMING_CACHE_DIR``, else ``~/.humming/cache``, as Humming 0.1
    resolves it in ``humming.utils.jit.get_humming_cache_dir``): keep it between runs and a start takes seconds."""
    import os

    return os.environ.get("HUMMING_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".humming", "cache")


def humming_shape_problem(out_features: Sequence[int] | int, in_features: int) -> str | None:
    """Why Humming cannot take a linear whose (per-shard) outputs are ``out_features`` (one per packed sub-module)
    and input ``in_features``; None when it can."""
    outs = [out_features] if isinstance(out_features, int) else list(out_features)
    bad_n = [n for n in outs if n % HUMMING_N_MULTIPLE]
    if bad_n:
        return f"output size {bad_n[0]} is not a multiple of {HUMMING_N_MULTIPLE}"
    if in_features % HUMMING_K_MULTIPLE:
        return f"input size {in_features} is not a multiple of {HUMMING_K_MULTIPLE}"
    return None


def decoder_linear_shapes(config: Mapping[str, Any], tp_size: int = 1) -> dict[str, tuple[int, int]]:
    """``{leaf module: (out, in)}`` of a dense decoder layer's linears on one tensor-parallel shard (column-parallel
    q/k/v/gate/up split their outputs, row-parallel o/down their inputs; K/V heads are replicated when there are
    fewer than ``tp_size``)."""
    text = config.get("text_config") or config
    h, inter = int(text["hidden_size"]), int(text["intermediate_size"])
    heads, kv = int(text["num_attention_heads"]), int(text.get("num_key_value_heads") or text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or h // heads)
    kv_local = max(1, kv // tp_size) * head_dim
    q_local = heads * head_dim // tp_size
    return {
        "q_proj": (q_local, h), "k_proj": (kv_local, h), "v_proj": (kv_local, h), "o_proj": (h, q_local),
        "gate_proj": (inter // tp_size, h), "up_proj": (inter // tp_size, h), "down_proj": (h, inter // tp_size),
    }  # fmt: skip


#: the linears vLLM packs into one layer (one kernel for the pack): a misfit of one sends its pack to Marlin
PACKS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _shape_misfits(shapes: Mapping[str, tuple[int, int]], modules: Iterable[str] | None) -> dict[str, str]:
    wanted = set(shapes) if modules is None else set(modules) & set(shapes)
    out = {}
    for name in sorted(wanted):
        problem = humming_shape_problem(shapes[name][0], shapes[name][1])
        if problem:
            out[name] = problem
    for pack in PACKS:
        bad = [n for n in pack if n in out]
        for n in pack:
            if bad and n in wanted and n not in out:
                out[n] = f"packed with {bad[0]}"
    return dict(sorted(out.items()))


def check_humming_for_experts(requested: str, *, per_layer: bool, model_config: Mapping[str, Any]) -> None:
    """``vllm_fp4_kernel='humming'`` with ``vllm_lora_backend='vllm'`` on a mixture-of-experts model cannot load
    (:data:`HUMMING_MOE_PROBLEM`): an error that says what to do, which the trainer raises before any weight loads."""
    if requested == "humming" and not per_layer and moe_expert_count(model_config) > 0:
        raise ValueError(
            "vllm_fp4_kernel='humming' with vllm_lora_backend='vllm' serves the whole model through vLLM's Humming "
            f"method, and {HUMMING_MOE_PROBLEM}. Set vllm_fp4_kernel='auto' (Marlin here) or "
            "vllm_lora_backend='qerl' (Humming for the attention, Marlin MoE for the experts)."
        )


def choose_fp4_kernel(
    requested: str,
    *,
    per_layer: bool,
    model_config: Mapping[str, Any],
    tp_size: int = 1,
    capability: tuple[int, int] | None,
    humming_version: str | None,
    quantized_modules: Iterable[str] | None = None,
) -> FP4KernelChoice:
    """Resolve ``QeRLGRPOConfig.vllm_fp4_kernel`` for one engine.

    ``per_layer``: the engine can run Marlin on the layers Humming cannot take (``vllm_lora_backend="qerl"``);
    ``capability``: the GPU's compute capability (None: no GPU); ``quantized_modules``: the leaf names quantized
    (default: every decoder linear). ``"humming"`` raises, with what to do, where Humming cannot run at all.
    """
    if requested not in FP4_KERNELS:
        raise ValueError(f"vllm_fp4_kernel must be one of {FP4_KERNELS}, got {requested!r}.")
    if requested == "marlin":
        return FP4KernelChoice("marlin", "vllm_fp4_kernel='marlin'")
    moe = moe_expert_count(model_config) > 0
    shapes = decoder_linear_shapes(model_config, tp_size)
    if moe:  # the MLP is the experts, on vLLM's MoE method whatever the linears run on
        shapes = {k: v for k, v in shapes.items() if k in MOE_LORA_TARGETS}
    misfits = _shape_misfits(shapes, quantized_modules)
    misfit_text = ", ".join(f"{k}: {v}" for k, v in misfits.items())
    if requested == "humming":
        if humming_version is None:
            raise humming_missing()
        check_humming_for_experts(requested, per_layer=per_layer, model_config=model_config)
        if misfits and not per_layer:
            raise ValueError(
                f"vllm_fp4_kernel='humming' with vllm_lora_backend='vllm' serves the whole model on Humming, which "
                f"cannot take this model's layers ({misfit_text}). Set vllm_fp4_kernel='auto' (Marlin here) or "
                "vllm_lora_backend='qerl' (Marlin for those layers only)."
            )
        reason = "vllm_fp4_kernel='humming'" + (EXPERTS_ON_MARLIN if moe else "")
        if misfits:
            return FP4KernelChoice("humming", f"{reason}; on Marlin by shape: {misfit_text}", tuple(misfits))
        return FP4KernelChoice("humming", reason)
    # auto
    if humming_version is None:
        return FP4KernelChoice("marlin", f"auto: {HUMMING_DIST} is not installed (pip install 'qerl-trl[vllm]')")
    if capability is None:
        return FP4KernelChoice("marlin", "auto: no CUDA GPU visible")
    if capability[0] not in HUMMING_AUTO_MAJORS:
        return FP4KernelChoice("marlin", f"auto: the GPU is sm_{capability[0]}{capability[1]}, Humming is picked on "
                                         "Hopper (sm_90) only")  # fmt: skip
    if moe and not per_layer:
        return FP4KernelChoice("marlin", "auto: a mixture-of-experts model, and vllm_lora_backend='vllm' serves the "
                                         f"model on one kernel; {HUMMING_MOE_PROBLEM}")  # fmt: skip
    if misfits and not per_layer:
        return FP4KernelChoice("marlin", f"auto: Humming cannot take every layer ({misfit_text}) and "
                                         "vllm_lora_backend='vllm' serves the model on one kernel")  # fmt: skip
    reason = f"auto: Hopper sm_{capability[0]}{capability[1]}, {HUMMING_DIST} {humming_version}"
    if moe:
        reason += EXPERTS_ON_MARLIN
    if misfits:
        return FP4KernelChoice("humming", f"{reason}; on Marlin by shape: {misfit_text}", tuple(misfits))
    return FP4KernelChoice("humming", reason)
