"""``NVFP4Experts``: a mixture-of-experts layer's routed experts, frozen in NVFP4, trained through.

Why: transformers 5.17+ keeps a MoE decoder's routed experts as two fused 3-D parameters per layer
(``Qwen3MoeExperts.gate_up_proj`` [experts, 2 * width, hidden] and ``down_proj`` [experts, hidden, width]), not as
Linears, so :class:`~qerl_trl.nvfp4.NVFP4Linear` cannot hold them. This module holds both stacks packed (4.5 bits a
weight: Qwen3-30B-A3B's experts take 16 GB instead of 58) and computes transformers' eager expert pass, each expert's
two matmuls through the NVFP4 ops :class:`NVFP4Linear` uses (the tokens sorted by expert, one slice each), or, in
bf16 where torch has a grouped GEMM, one grouped GEMM a projection over the layer's dequantized stack, as transformers
runs BF16 experts. Nothing dequantized is kept for backward. Gradients reach the hidden states and the routing
weights (so the router and any LoRA below learn); the experts stay frozen.

Its state dict is per expert, as llm-compressor saves a MoE for vLLM (``<prefix><e>.gate_proj.weight_packed`` /
``weight_scale`` / ``weight_global_scale``, ``up_proj``, ``down_proj``): gate and up share the expert's global scale,
as vLLM serves them as one matrix (``CompressedTensorsW4A4Nvfp4MoEMethod`` warns and takes gate's otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import format as nvfp4
from .linear import ACTIVATION_DTYPES, _NVFP4LinearFn
from .ops import dequantize_stack, nvfp4_linear_forward

__all__ = ["NVFP4Experts", "NVFP4ExpertsCheckpoint", "Routed", "grouped_mm", "grouped_mm_usable"]

#: torch's grouped GEMM (``torch.nn.functional.grouped_mm``, earlier ``torch._grouped_mm``)
_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM: ``out[s] = x[s] @ w[e(s)]`` over rows sorted by group (``offsets``: where each ends)."""
    return _GROUPED_MM(x, w, offs=offsets)


def grouped_mm_usable(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these activations: bf16 on CUDA sm_80+ or the CPU, torch >= 2.9 (before,
    Hopper only and no CPU kernel). transformers 5.17 runs BF16 experts on it by default (its
    ``experts_implementation="grouped_mm"``), one GEMM a projection a layer instead of one an expert."""
    if _GROUPED_MM is None or x.dtype != torch.bfloat16 or _TORCH < (2, 9):
        return False
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu"


class _GroupedExpertsFn(torch.autograd.Function):
    """``y[s] = x[s] @ Ŵ_e(s)ᵀ`` over rows sorted by expert (``offsets``: where each expert's rows end), one grouped
    GEMM. The stack is dequantized for the call and again in backward, never saved (one stack, about 0.8 GB at
    Qwen3-30B-A3B's gate/up, exists at a time); backward returns only the input gradient: the experts are frozen."""

    @staticmethod
    def forward(ctx, x, offsets, experts, stack):
        ctx.experts, ctx.stack = experts, stack
        ctx.save_for_backward(offsets)
        return _GROUPED_MM(x, experts.dequantize_stack(stack, x).transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, dy):
        (offsets,) = ctx.saved_tensors
        dx = _GROUPED_MM(dy.contiguous(), ctx.experts.dequantize_stack(ctx.stack, dy), offs=offsets)
        return dx, None, None, None

#: the packed stacks: (stack, the per-expert checkpoint projections it holds, in row order)
STACKS = (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",)))
#: each stack's tensors: (attribute suffix, the dtype it is read as, checkpoint key). The scales are held as integer
#: bit patterns (float8 as uint8, float32 as int32), so ``model.to(torch.bfloat16)`` casts none of them.
TENSORS = (("packed", torch.uint8, "weight_packed"), ("scale_bits", torch.float8_e4m3fn, "weight_scale"),
           ("global_scale_bits", torch.float32, "weight_global_scale"))  # fmt: skip
_BITS = {torch.uint8: torch.uint8, torch.float8_e4m3fn: torch.uint8, torch.float32: torch.int32}


@dataclass
class Routed:
    """A layer's (token, slot) pairs sorted by expert: ``rows`` (the tokens' activations in that order), where each
    pair came from (``order``, ``token_of``), and each expert's rows: ``offsets`` (where each expert's rows end, for
    the grouped GEMM) or ``slices`` ([(expert, start, end)], the experts with rows, for the per-expert loop)."""

    rows: torch.Tensor
    order: torch.Tensor
    token_of: torch.Tensor
    offsets: torch.Tensor | None = None
    slices: list[tuple[int, int, int]] | None = None


class NVFP4Experts(nn.Module):
    """Frozen NVFP4 routed experts with the forward of transformers' fused experts
    (``forward(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k])``).

    State: ``gate_up_packed`` uint8 [experts, 2 * width, hidden / 2], ``gate_up_scale_bits`` (float8_e4m3fn
    scales as uint8) [experts, 2 * width, hidden / 16], ``gate_up_global_scale_bits`` (float32 as int32) [experts];
    ``down_*`` likewise for [experts, hidden, width]; :meth:`tensors` reads them typed. Build it with
    :meth:`from_experts`.
    """

    def __init__(self, num_experts: int, hidden: int, width: int, act_fn: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device | str | None = None) -> None:  # fmt: skip
        super().__init__()
        if hidden % nvfp4.BLOCK_SIZE or width % nvfp4.BLOCK_SIZE:
            raise ValueError(f"NVFP4 experts need hidden and expert width divisible by {nvfp4.BLOCK_SIZE}, got "
                             f"hidden={hidden}, width={width}; keep this model in 16-bit")  # fmt: skip
        self.num_experts, self.hidden, self.width, self.act_fn = num_experts, hidden, width, act_fn
        for stack, (rows, cols) in (("gate_up", (2 * width, hidden)), ("down", (hidden, width))):
            shapes = ((num_experts, rows, cols // 2), (num_experts, rows, cols // nvfp4.BLOCK_SIZE), (num_experts,))
            for (suffix, dtype, _), shape in zip(TENSORS, shapes):
                tensor = torch.zeros(shape, dtype=_BITS[dtype], device=device)
                setattr(self, f"{stack}_{suffix}", nn.Parameter(tensor, requires_grad=False))

    @classmethod
    def from_experts(cls, experts: nn.Module, name: str = "experts") -> NVFP4Experts:
        """Quantize transformers' fused experts (``gate_up_proj`` / ``down_proj`` 3-D parameters and ``act_fn``),
        one expert at a time: each expert's gate and up rows under one global scale, its down rows under another
        (bit-identical to compressed-tensors' NVFP4 of each expert's Linears; see :func:`~qerl_trl.nvfp4.quantize`)."""
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        num_experts, two_width, hidden = gate_up.shape
        if tuple(down.shape) != (num_experts, hidden, two_width // 2):
            raise ValueError(f"{name}: down_proj has shape {tuple(down.shape)}, expected "
                             f"{(num_experts, hidden, two_width // 2)} for gate_up_proj {tuple(gate_up.shape)}")
        out = cls(num_experts, hidden, two_width // 2, experts.act_fn, device=gate_up.device)
        out.load_stack("gate_up", gate_up, name)
        out.load_stack("down", down, name)
        return out

    def load_stack(self, stack: str, weights: torch.Tensor, name: str = "experts") -> None:
        """Quantize a 16-bit stack (``"gate_up"`` [experts, 2 * width, hidden] or ``"down"`` [experts, hidden,
        width]) into this module, one expert at a time, each under its own global scale (so gate and up share one)."""
        want = tuple(getattr(self, f"{stack}_packed").shape)
        if tuple(weights.shape) != (want[0], want[1], want[2] * 2):
            raise ValueError(f"{name}: the {stack} stack has shape {tuple(weights.shape)}, expected "
                             f"{(want[0], want[1], want[2] * 2)}")  # fmt: skip
        for e in range(self.num_experts):
            q = nvfp4.quantize(weights[e].detach(), global_scale=nvfp4.compute_global_scale(weights[e].detach()),
                               name=f"{name}.{e}.{stack}")  # fmt: skip
            for (suffix, dtype, _), tensor in zip(TENSORS, q):
                bits = tensor.view(_BITS[dtype])
                getattr(self, f"{stack}_{suffix}").data[e] = bits.reshape(()) if bits.ndim == 1 else bits

    def tensors(self, stack: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``stack``'s (``"gate_up"`` or ``"down"``) packed codes, float8 scales and float32 global scales, typed."""
        return tuple(getattr(self, f"{stack}_{suffix}").view(dtype) for suffix, dtype, _ in TENSORS)

    def dequantize(self, stack: str, expert: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """One expert's dense ``gate_up`` [2 * width, hidden] or ``down`` [hidden, width] (for checks and export)."""
        return nvfp4.dequantize(*self._expert(stack, expert), dtype=dtype)

    def dequantize_stack(self, stack: str, like: torch.Tensor) -> torch.Tensor:
        """Every expert's dense ``stack`` [experts, rows, cols] in ``like``'s dtype (one Triton launch on the GPU),
        for the grouped GEMM."""
        return dequantize_stack(like, *self.tensors(stack))

    def _expert(self, stack: str, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        packed, scale, global_scale = self.tensors(stack)
        return packed[e], scale[e], global_scale[e : e + 1]

    def _matmul(self, x: torch.Tensor, stack: str, e: int) -> torch.Tensor:
        packed, scale, global_scale = self._expert(stack, e)
        if x.requires_grad and torch.is_grad_enabled():
            return _NVFP4LinearFn.apply(x, packed, scale, global_scale)
        return nvfp4_linear_forward(x, packed, scale, global_scale)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        hidden_states = self.check_input(hidden_states)
        routed = self.route(hidden_states, top_k_index)
        if routed is None:
            return torch.zeros_like(hidden_states)
        gate, up = self.project(routed, routed.rows, "gate_up").chunk(2, dim=-1)
        return self.combine(routed, self.project(routed, self.act_fn(gate) * up, "down"), top_k_weights,
                            hidden_states)  # fmt: skip

    # -- the pass in parts (a LoRA over the experts adds its terms between them: peft_lora.NVFP4ExpertsLora) -------
    def check_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The activations in the autocast dtype where autocast is on; bf16/fp16/fp32 only."""
        if torch.is_autocast_enabled(hidden_states.device.type):
            hidden_states = hidden_states.to(torch.get_autocast_dtype(hidden_states.device.type))
        if hidden_states.dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"NVFP4Experts takes bf16/fp16/fp32 activations, got {hidden_states.dtype}")
        return hidden_states

    def route(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> Routed | None:
        """The (token, slot) pairs sorted by expert, each expert's rows one slice (None: no pair). Grouped (bf16):
        two grouped GEMMs a projection and no host sync. Else one GEMM pair an expert and one host sync a layer (the
        counts), where transformers' eager loop syncs twice an expert: 128 experts x 48 layers x 3 passes a
        micro-batch at Qwen3-30B-A3B."""
        k = top_k_index.shape[-1]
        with torch.no_grad():
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=self.num_experts)
            token_of = torch.div(order, k, rounding_mode="floor")
        rows = hidden_states[token_of]
        if grouped_mm_usable(rows):
            return Routed(rows, order, token_of, offsets=torch.cumsum(counts, 0, dtype=torch.int32))
        slices, start = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                slices.append((e, start, start + n))
                start += n
        return Routed(rows, order, token_of, slices=slices) if slices else None

    def project(self, routed: Routed, x: torch.Tensor, stack: str) -> torch.Tensor:
        """``x`` (rows in the routed order) through each row's expert's ``stack`` (``"gate_up"`` or ``"down"``)."""
        if routed.offsets is not None:
            return _GroupedExpertsFn.apply(x, routed.offsets, self, stack)
        return torch.cat([self._matmul(x[a:b], stack, e) for e, a, b in routed.slices])

    @staticmethod
    def combine(routed: Routed, out: torch.Tensor, top_k_weights: torch.Tensor,
                hidden_states: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Each row's output weighted by its routing weight, summed back onto its token."""
        out = out * top_k_weights.reshape(-1)[routed.order, None]
        return torch.zeros_like(hidden_states).index_add_(0, routed.token_of, out.to(hidden_states.dtype))

    # -- state dict: per expert, as llm-compressor saves a MoE for vLLM --------------------------------------------
    def _per_expert(self, prefix: str):
        """``(checkpoint key, stack, expert, row slice, tensor index)`` of every per-expert tensor."""
        for stack, projections in STACKS:
            rows = getattr(self, f"{stack}_packed").shape[1] // len(projections)
            for e in range(self.num_experts):
                for i, proj in enumerate(projections):
                    for t, (_, _, key) in enumerate(TENSORS):
                        yield f"{prefix}{e}.{proj}.{key}", stack, e, slice(i * rows, (i + 1) * rows), t

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # typed copies, not views: checkpoint writers refuse tensors that share storage
        for key, stack, e, rows, t in self._per_expert(prefix):
            typed = self.tensors(stack)[t][e]
            destination[key] = typed.reshape(1).clone() if typed.ndim == 0 else typed[rows].clone()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):  # fmt: skip
        for key, stack, e, rows, t in self._per_expert(prefix):
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            target = self.tensors(stack)[t][e]
            value = state_dict[key].to(target.device)
            want = target.reshape(1) if target.ndim == 0 else target[rows]
            if tuple(value.shape) != tuple(want.shape) or value.dtype != want.dtype:
                error_msgs.append(f"{key}: {value.dtype} {tuple(value.shape)}, expected {want.dtype} "
                                  f"{tuple(want.shape)}")  # fmt: skip
                continue
            with torch.no_grad():
                want.copy_(value)  # a view of this module's parameter
        if strict:
            mine = {key for key, *_ in self._per_expert(prefix)}
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in mine)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden}, width={self.width}, format=nvfp4"


class NVFP4ExpertsCheckpoint(nn.Module):
    """Where an NVFP4A16 MoE checkpoint's experts land while transformers loads it: its per-expert tensors, stacked
    by the loader's weight conversion (``NVFP4HfQuantizer.update_weight_conversions``), in their checkpoint dtypes,
    gate's and up's global scales side by side. :meth:`to_experts` then gives the :class:`NVFP4Experts` holding
    the same tensors (no copy but the global scales)."""

    def __init__(self, num_experts: int, hidden: int, width: int, act_fn: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device | str | None = "meta") -> None:  # fmt: skip
        super().__init__()
        self.num_experts, self.hidden, self.width, self.act_fn = num_experts, hidden, width, act_fn
        #: ``{parameter: (shape, dtype)}`` the checkpoint must fill
        self.expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for stack, (rows, cols), shards in (("gate_up", (2 * width, hidden), 2), ("down", (hidden, width), 1)):
            for suffix, shape, dtype in (("packed", (num_experts, rows, cols // 2), torch.uint8),
                                         ("scale", (num_experts, rows, cols // nvfp4.BLOCK_SIZE), torch.float8_e4m3fn),
                                         ("global_scale", (num_experts, shards), torch.float32)):  # fmt: skip
                self.expected[f"{stack}_{suffix}"] = (shape, dtype)
                tensor = torch.empty(shape, dtype=dtype, device=device)
                setattr(self, f"{stack}_{suffix}", nn.Parameter(tensor, requires_grad=False))

    def to_experts(self, name: str = "experts") -> NVFP4Experts:
        """The loaded experts as :class:`NVFP4Experts`; gate and up must share each expert's global scale (vLLM
        serves them as one matrix, and so does this module)."""
        gate_up_gs = self.gate_up_global_scale.detach()
        if not torch.equal(gate_up_gs[:, 0], gate_up_gs[:, 1]):
            raise ValueError(f"{name}: the checkpoint's gate_proj and up_proj global scales differ for some experts; "
                             "NVFP4 experts need one per expert (as llm-compressor writes them).")  # fmt: skip
        out = NVFP4Experts(self.num_experts, self.hidden, self.width, self.act_fn, device="meta")
        for stack, gs in (("gate_up", gate_up_gs[:, 0]), ("down", self.down_global_scale.detach()[:, 0])):
            typed = (getattr(self, f"{stack}_packed").detach(), getattr(self, f"{stack}_scale").detach(),
                     gs.contiguous())  # fmt: skip
            for (suffix, dtype, _), tensor in zip(TENSORS, typed):
                setattr(out, f"{stack}_{suffix}", nn.Parameter(tensor.view(_BITS[dtype]), requires_grad=False))
        return out
