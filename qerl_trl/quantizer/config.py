"""``NVFP4Config``: the user-facing quantization config (what to quantize, which tensors share a global scale)."""

from __future__ import annotations

from typing import Any, Iterable

from transformers.utils.quantization_config import QuantizationConfigMixin

#: In-memory quant_method. Not "nvfp4": transformers >= 5.23 ships its own (Blackwell-only) ``NVFP4Config``
#: under that name. On disk we always write ``quant_method: "compressed-tensors"`` (see ``checkpoint.py``).
QUANT_METHOD = "qerl_nvfp4"

#: Sibling Linears that vLLM fuses into one GEMM (qkv_proj, gate_up_proj); they must share one global scale.
DEFAULT_FUSED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class NVFP4Config(QuantizationConfigMixin):
    """Quantize a causal LM's Linear weights to NVFP4 (4-bit E2M1, FP8 block scales, FP32 global scale).

    Pass it to ``from_pretrained`` on a 16-bit checkpoint to quantize while loading, layer by layer::

        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config(), dtype=torch.bfloat16)

    To load an NVFP4 checkpoint (ours or llm-compressor's ``NVFP4A16``) packed and trainable, use
    :func:`qerl_trl.load_nvfp4`. ``save_pretrained`` writes the compressed-tensors ``nvfp4-pack-quantized``
    layout that vLLM serves directly.

    Args:
        modules_to_not_convert: module names (exact, dotted suffix such as ``"mlp.down_proj"``, or a
            ``"re:<regex>"`` matched against the full name) that stay 16-bit. The output embedding
            (``lm_head``) always stays 16-bit; embeddings and norms are not Linears and are never touched.
        fused_groups: names of sibling Linears that share one global scale (vLLM fuses them into one GEMM and
            requires it). Default: ``q_proj/k_proj/v_proj`` and ``gate_proj/up_proj``.
        checkpoint_ignore: set by :func:`qerl_trl.load_nvfp4` from a compressed-tensors checkpoint's ``ignore``
            list; only used when the checkpoint files cannot be inspected to find its packed modules.
    """

    def __init__(
        self,
        modules_to_not_convert: Iterable[str] | None = None,
        fused_groups: Iterable[Iterable[str]] | None = None,
        checkpoint_ignore: Iterable[str] | None = None,
        **kwargs: Any,
    ) -> None:
        quant_method = kwargs.pop("quant_method", QUANT_METHOD)
        if quant_method != QUANT_METHOD:
            raise ValueError(f"NVFP4Config has quant_method {QUANT_METHOD!r}, got {quant_method!r}")
        if kwargs:
            raise TypeError(f"NVFP4Config got unexpected arguments: {sorted(kwargs)}")
        self.quant_method = QUANT_METHOD
        if isinstance(modules_to_not_convert, str):
            modules_to_not_convert = [modules_to_not_convert]
        self.modules_to_not_convert = None if modules_to_not_convert is None else list(modules_to_not_convert)
        groups = DEFAULT_FUSED_GROUPS if fused_groups is None else fused_groups
        self.fused_groups = [list(g) for g in groups]
        for g in self.fused_groups:
            if not g or not all(isinstance(n, str) and n for n in g):
                raise ValueError(f"fused_groups must be lists of module names, got {g!r}")
        self.checkpoint_ignore = None if checkpoint_ignore is None else list(checkpoint_ignore)

    def get_loading_attributes(self) -> dict[str, Any]:
        return {}
