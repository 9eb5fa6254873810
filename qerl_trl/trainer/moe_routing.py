"""Does vLLM send a mixture-of-experts policy's tokens to the experts the trainer does? (issue #54)

Why it can differ: the trainer's policy and vLLM's engine compute each router from the same 16-bit router weights,
but from hidden states that differ by their kernels' rounding (the trainer's dequantized NVFP4 GEMMs against vLLM's
Humming and Marlin). Where a token's k-th and (k+1)-th router logits are nearly tied, the two can pick different
experts, and the rollout's log-probs then come through an expert that training does not use. Routing that differs
where the trainer's router is *not* near a tie means the engine is not running the trained policy (other router
weights, noise left in its norms, a wrong expert order).

:func:`vllm_routing` reads vLLM's choices (vLLM 0.24's ``enable_return_routed_experts``, which
``QeRLGRPOConfig(vllm_return_routed_experts=True)`` turns on); :func:`trainer_routing` takes the trainer's from
forward hooks on its routers; :func:`routing_agreement` compares them token by token and layer by layer, with the
trainer's logit margin at each disagreement. :func:`check_routing` runs the three on one sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["check_routing", "routers_of", "routing_agreement", "trainer_routing", "vllm_routing"]


def routers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The routers of ``model`` in layer order: each MoE block's ``gate`` that returns ``(logits, weights, indices)``
    (transformers 5.17's ``Qwen3MoeTopKRouter``: a ``top_k`` and an ``[experts, hidden]`` weight)."""
    return [(name, module) for name, module in model.named_modules()
            if name.endswith("mlp.gate") and isinstance(getattr(module, "top_k", None), int)
            and getattr(getattr(module, "weight", None), "ndim", 0) == 2]  # fmt: skip


def trainer_routing(model: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [tokens, layers, k], logits [tokens, layers, experts])`` of the trainer's routers for one sequence
    (``input_ids`` of shape ``[tokens]``), from one no-grad forward of ``model`` as it stands (adapter on)."""
    routers = routers_of(model)
    if not routers:
        raise ValueError("the model has no MoE router (an 'mlp.gate' with top_k): routing is checked on a MoE policy")
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name):
        def record(module, args, output):
            logits, _, indices = output
            seen[name] = (indices.detach(), logits.detach().float())

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in routers]
    try:
        with torch.no_grad():
            model(input_ids=input_ids.reshape(1, -1))
    finally:
        for h in handles:
            h.remove()
    missing = [n for n, _ in routers if n not in seen]
    if missing:
        raise RuntimeError(f"the forward did not run the routers {missing[:3]}")
    indices = torch.stack([seen[n][0] for n, _ in routers], dim=1)
    logits = torch.stack([seen[n][1] for n, _ in routers], dim=1)
    return indices.cpu(), logits.cpu()


def vllm_routing(llm: Any, token_ids: Sequence[int], lora_request: Any = None) -> torch.Tensor:
    """vLLM's routing of ``token_ids`` as ``[tokens, layers, k]`` expert indices: one prefill of the sequence (a
    request for one more token), whose output carries the experts each prompt token was routed to. ``llm``: a
    ``vllm.LLM`` started with ``enable_return_routed_experts=True``."""
    from vllm import SamplingParams

    llm.reset_prefix_cache()  # cached prompt blocks would return routing computed before a sync
    out = llm.generate([{"prompt_token_ids": list(token_ids)}], SamplingParams(max_tokens=1, temperature=0.0),
                       lora_request=lora_request, use_tqdm=False)  # fmt: skip
    routed = out[0].outputs[0].routed_experts
    if routed is None:
        raise ValueError("vLLM returned no routed experts: start the engine with "
                         "QeRLGRPOConfig(vllm_return_routed_experts=True) (vLLM's enable_return_routed_experts)")
    routed = torch.as_tensor(routed)
    if routed.dim() != 3 or routed.shape[0] < len(token_ids):
        raise ValueError(f"vLLM's routed experts have shape {tuple(routed.shape)}, expected [>= {len(token_ids)}, "
                         "layers, k]")  # fmt: skip
    return routed[: len(token_ids)].long()


def routing_agreement(trainer_indices: torch.Tensor, trainer_logits: torch.Tensor,
                      vllm_indices: torch.Tensor) -> dict[str, Any]:  # fmt: skip
    """Token-by-layer agreement of two routings of the same tokens (``[tokens, layers, k]`` each; the trainer's
    router logits ``[tokens, layers, experts]``).

    - ``same_experts``: the fraction of (token, layer) pairs whose k experts are the same set;
    - ``same_slots``: the fraction of the k choices both made;
    - ``worst_layer``: the lowest ``same_experts`` of a layer;
    - ``disagreements``: how many (token, layer) pairs differ, and ``max_tie_gap``: over them, the largest gap in
      the trainer's logits between an expert only the trainer chose and one only vLLM chose, in units of that
      token's logit standard deviation (0: a tie, which rounding may break either way)."""
    if trainer_indices.shape != vllm_indices.shape:
        raise ValueError(f"routings of different shapes: trainer {tuple(trainer_indices.shape)}, vLLM "
                         f"{tuple(vllm_indices.shape)} (the same tokens, layers and k are compared)")  # fmt: skip
    experts = trainer_logits.shape[-1]
    if int(vllm_indices.max()) >= experts or int(vllm_indices.min()) < 0:
        raise ValueError(f"vLLM routed to expert {int(vllm_indices.max())}, the model has {experts}")
    t = torch.zeros(*trainer_indices.shape[:2], experts, dtype=torch.bool).scatter_(-1, trainer_indices.long(), True)
    v = torch.zeros(*vllm_indices.shape[:2], experts, dtype=torch.bool).scatter_(-1, vllm_indices.long(), True)
    same = (t == v).all(-1)  # [tokens, layers]
    k = trainer_indices.shape[-1]
    logits = trainer_logits.float()
    spread = logits.std(-1).clamp_min(1e-12)
    only_t = torch.where(t & ~v, logits, torch.full_like(logits, float("inf"))).amin(-1)  # weakest dropped choice
    only_v = torch.where(v & ~t, logits, torch.full_like(logits, float("-inf"))).amax(-1)  # strongest added one
    gap = ((only_t - only_v) / spread)[~same]
    return {
        "tokens": int(same.shape[0]),
        "layers": int(same.shape[1]),
        "top_k": k,
        "same_experts": round(float(same.float().mean()), 5),
        "same_slots": round(float((t & v).sum()) / float(t.sum()), 5),
        "worst_layer": round(float(same.float().mean(0).min()), 5),
        "disagreements": int((~same).sum()),
        "max_tie_gap": round(float(gap.max()), 5) if gap.numel() else 0.0,
    }


def check_routing(trainer: Any, token_ids: Sequence[int]) -> dict[str, Any]:
    """:func:`routing_agreement` of the trainer's policy and its colocated vLLM engine on ``token_ids`` (with the
    round's adapter under the ``"vllm"`` backend). The caller syncs first what the comparison should see: the LoRA,
    and the noise-free norms for a noise-free round."""
    model = trainer.model
    was_training = model.training
    model.eval()
    try:
        device = next(p.device for p in model.parameters())
        indices, logits = trainer_routing(model, torch.tensor(list(token_ids), device=device))
    finally:
        if was_training:
            model.train()
    proxy = trainer.vllm_generation.llm  # QeRL's LoRA-serving proxy of the engine
    request = proxy.lora_request if getattr(proxy, "adapters", False) else None
    engine = getattr(proxy, "_llm", proxy)
    return routing_agreement(indices, logits, vllm_routing(engine, token_ids, request))
