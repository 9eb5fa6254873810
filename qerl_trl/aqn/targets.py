"""Which norm weights AQN perturbs: found from the decoder layers' data flow, not from class names.

QeRL folds its channel-wise noise into the norm in front of q/k/v (``input_layernorm``) and the one in front of
gate/up (``post_attention_layernorm``): ``(w + z) ⊙ x̂`` feeds those projections exactly what ``Ŵ·diag(1 + z/w)``
would. The published code found these norms by matching transformers' RMSNorm class, which never matched inside
vLLM's model, so its noise never reached a rollout. Here the targets are found by structure:

1. the decoder layers are the entries of a ``ModuleList`` in the model;
2. a norm candidate is a submodule of a layer whose only own parameter is a 1-D ``weight`` of size ``hidden``
   (RMSNorm-like: a bias would break the ``Ŵ·diag(1 + z/w)`` equivalence);
3. one tiny forward pass (4 tokens, no grad, eval mode) with hooks traces which Linear-like modules (anything
   with ``in_features``/``out_features``: ``nn.Linear``, ``NVFP4Linear``, PEFT LoRA layers; and a MoE's packed
   NVFP4 experts, FP4 projections of the hidden state like gate/up, so a MoE gets noise in both norms) consume a norm's
   output tensor (the projections return zeros meanwhile: their arithmetic is not needed, and on a CPU it takes
   minutes at 14B); a candidate that feeds at least one projection is a target, and ``feeds`` names the
   outermost consumers (``q_proj``, not ``q_proj.base_layer`` or ``q_proj.lora_A.default``).

So ``o_proj``/``down_proj`` (fed by attention / the activation) and the final norm (outside the layers, feeding
``lm_head``) get no noise, Qwen3's ``q_norm``/``k_norm`` (size ``head_dim``, feeding attention) neither.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ..nvfp4.experts import NVFP4Experts

__all__ = ["NoiseTarget", "AQNStructureError", "find_noise_targets", "vllm_param_name"]


class AQNStructureError(ValueError):
    """The model's decoder-layer structure (norm -> projections) was not found."""


@dataclass(frozen=True)
class NoiseTarget:
    """One norm weight AQN perturbs.

    ``name`` is the weight's parameter name relative to the model given to :func:`find_noise_targets`
    (e.g. ``"model.layers.0.input_layernorm.weight"``, or with a ``"base_model.model."`` prefix under PEFT);
    ``feeds`` names the projections that consume the norm's output, e.g. ``("q_proj", "k_proj", "v_proj")``.
    """

    name: str
    module: nn.Module = field(compare=False, repr=False)
    layer_index: int
    feeds: tuple[str, ...]

    @property
    def module_name(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def hidden_size(self) -> int:
        return int(self.module.weight.shape[0])


# Path segments added by wrappers around a transformers model: PEFT (PeftModel.base_model -> LoraModel.model),
# DDP/DeepSpeed (`module.`), torch.compile (`_orig_mod.`), activation-checkpoint and FSDP wrappers.
_WRAPPER_PREFIX = re.compile(r"^(?:module\.|_orig_mod\.|base_model\.model\.)+")
_WRAPPER_SEGMENT = re.compile(r"(^|\.)(?:_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")


def vllm_param_name(target: NoiseTarget | str) -> str:
    """The name vLLM uses for the same parameter (idempotent: a vLLM name maps to itself).

    For Llama/Qwen2/Qwen3/Mistral, vLLM's ``*ForCausalLM`` keeps transformers' module tree
    (``model.layers.N.input_layernorm.weight`` / ``model.layers.N.post_attention_layernorm.weight``), so only
    wrapper prefixes (PEFT's ``base_model.model.``, ``module.``, ``_orig_mod.``) are stripped.
    """
    name = target.name if isinstance(target, NoiseTarget) else str(target)
    name = _WRAPPER_SEGMENT.sub(r"\1", name)
    return _WRAPPER_PREFIX.sub("", name)


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text_config, "hidden_size", None)
    if isinstance(hidden, int) and hidden > 0:
        return hidden
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return int(emb.weight.shape[-1])
    raise AQNStructureError(
        f"AQN cannot tell the hidden size of {type(model).__name__}: it has no config.hidden_size and no input "
        "embeddings. Pass a transformers causal LM (optionally wrapped by PEFT)."
    )


def _is_norm_candidate(module: nn.Module, hidden: int) -> bool:
    own = dict(module.named_parameters(recurse=False))
    w = own.get("weight")
    return (
        set(own) == {"weight"}
        and isinstance(w, torch.Tensor)
        and w.ndim == 1
        and w.shape[0] == hidden
        and w.is_floating_point()
    )


def _is_linear_like(module: nn.Module) -> bool:
    return isinstance(module, NVFP4Experts) or (
        isinstance(getattr(module, "in_features", None), int) and isinstance(getattr(module, "out_features", None), int)
    )


def _out_width(module: nn.Module) -> int:
    """A projection's output width: a Linear's ``out_features``; packed experts return the hidden state's."""
    return module.hidden if isinstance(module, NVFP4Experts) else module.out_features


def _tensor_args(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    vals = list(args) + list(kwargs.values())
    return [v for v in vals if isinstance(v, torch.Tensor)]


@contextlib.contextmanager
def _projections_return_zeros(model: nn.Module) -> Iterator[None]:
    """While tracing, every outermost Linear-like module returns zeros of its output shape instead of computing.

    The trace needs which module consumes which tensor, not the projections' arithmetic, and that arithmetic is
    the whole cost where the model is on the CPU (a model passed in, a CPU run), as an NVFP4 forward there
    dequantizes every weight: a 14B model's 4-token trace took 155 s on the GPU machine's CPU, when the trainer
    still loaded every policy onto the CPU. The pre-hooks still see each projection's input; modules inside a
    stubbed one (``base_layer``, ``lora_A``) are not called, and :func:`find_noise_targets` keeps only the
    outermost consumers anyway."""

    def zeros(module: nn.Module):
        def forward(*args, **kwargs):
            x = _tensor_args(args, kwargs)[0]
            return x.new_zeros(*x.shape[:-1], _out_width(module))

        return forward

    stubbed: list[tuple[nn.Module, object]] = []  # (module, its own instance forward, e.g. accelerate's hook)
    inside = None  # named_modules() is pre-order: a stubbed module's submodules come right after it
    for name, module in model.named_modules():
        if inside is not None and name.startswith(inside):
            continue
        if name and _is_linear_like(module):
            stubbed.append((module, vars(module).get("forward")))
            module.forward = zeros(module)
            inside = name + "."
    try:
        yield
    finally:
        for module, own in stubbed:
            if own is None:
                del module.forward
            else:
                module.forward = own


def _dummy_input(model: nn.Module) -> torch.Tensor:
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    device = emb.weight.device if emb is not None and getattr(emb, "weight", None) is not None else None
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    if device.type == "meta":
        raise AQNStructureError("AQN needs a model with real weights (it is on the meta device); load it first.")
    vocab = int(emb.weight.shape[0]) if emb is not None else 8
    return (torch.arange(4, device=device) % max(vocab, 1)).reshape(1, 4)


@torch.no_grad()
def find_noise_targets(model: nn.Module) -> list[NoiseTarget]:
    """The norm weights in front of the attention input projections and the MLP input projections.

    Works on a transformers causal LM, with the projections being ``nn.Linear``, ``NVFP4Linear`` or PEFT LoRA
    layers, and through a ``PeftModel``. Runs one 4-token forward (no grad, eval mode, modes restored after) in which
    the projections return zeros; a model whose forward fails that way is traced again with the real projections.
    Raises :class:`AQNStructureError`, listing what was found, when no decoder layers with norm -> projection
    structure exist, several layer lists have it, or some layer has fewer such norms than the others.
    """
    hidden = _hidden_size(model)
    names = {m: n for n, m in model.named_modules()}

    # Decoder-layer lists: ModuleLists whose entries hold norm candidates.
    layer_lists: list[tuple[str, nn.ModuleList, list[list[tuple[str, nn.Module]]]]] = []
    for list_name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        per_layer = []
        for layer in mod:
            per_layer.append(
                [(n, m) for n, m in layer.named_modules() if n and _is_norm_candidate(m, hidden)]
            )
        if any(per_layer):
            layer_lists.append((list_name, mod, per_layer))
    if not layer_lists:
        norms = [n for n, m in model.named_modules() if _is_norm_candidate(m, hidden)]
        raise AQNStructureError(
            f"AQN found no decoder layers in {type(model).__name__}: no nn.ModuleList holds a norm-like module "
            f"(exactly one parameter, a 1-D weight of size hidden={hidden}). Norm-like modules found anywhere: "
            f"{norms or 'none'}. AQN supports decoder-only LMs whose layers normalize with a bias-free "
            "(RMSNorm-like) norm in front of their projections (Llama, Qwen2, Qwen3, Mistral, ...)."
        )

    # Trace: which linear-like modules consume which norm's output (by tensor memory, so views also count).
    norm_out: list[tuple[nn.Module, torch.Tensor]] = []
    consumers: dict[nn.Module, list[str]] = {}
    hooks = []

    def on_norm(mod, args, out):
        if isinstance(out, torch.Tensor):
            norm_out.append((mod, out))

    def on_linear(mod, args, kwargs):
        for t in _tensor_args(args, kwargs):
            for norm, out in norm_out:
                if t is out or (t.numel() and t.data_ptr() == out.data_ptr() and t.numel() == out.numel()):
                    lst = consumers.setdefault(norm, [])
                    if names[mod] not in lst:
                        lst.append(names[mod])

    try:
        for _, mod, per_layer in layer_lists:
            for layer, cands in zip(mod, per_layer):
                for _, norm in cands:
                    hooks.append(norm.register_forward_hook(on_norm))
                for sub in layer.modules():
                    if _is_linear_like(sub):
                        hooks.append(sub.register_forward_pre_hook(on_linear, with_kwargs=True))
        modes = {m: m.training for m in model.modules()}
        model.eval()
        try:
            ids = _dummy_input(model)
            try:
                with _projections_return_zeros(model):
                    model(input_ids=ids)
            except AQNStructureError:
                raise
            except Exception:  # a model whose data flow needs the projections' values: trace with them
                norm_out.clear()
                consumers.clear()
                try:
                    model(input_ids=ids)
                except Exception as e:
                    raise AQNStructureError(
                        f"AQN traces which norm feeds which projection with one forward of input_ids={ids.tolist()} "
                        f"on {type(model).__name__}; that forward failed: {type(e).__name__}: {e}"
                    ) from e
        finally:
            for m, training in modes.items():
                m.training = training
    finally:
        for h in hooks:
            h.remove()
        norm_out.clear()

    found_lists = []
    report = []
    for list_name, mod, per_layer in layer_lists:
        desc_by_layer: list[str] = []
        targets: list[NoiseTarget] = []
        per_layer_count = []
        for idx, (layer, cands) in enumerate(zip(mod, per_layer)):
            layer_prefix = names[layer] + "."
            layer_targets = []
            desc = []
            for _, norm in cands:
                fed = [n for n in consumers.get(norm, []) if n.startswith(layer_prefix)]
                outer = [n for n in fed if not any(n != o and n.startswith(o + ".") for o in fed)]
                feeds = tuple(n.rsplit(".", 1)[-1] for n in outer)
                desc.append(f"{names[norm]} -> {list(feeds) or 'no projection'}")
                if feeds:
                    layer_targets.append(NoiseTarget(names[norm] + ".weight", norm, idx, feeds))
            per_layer_count.append(len(layer_targets))
            targets.extend(layer_targets)
            desc_by_layer.append(f"  {list_name}[{idx}]: " + ("; ".join(desc) or "no norm-like modules"))
        # Every layer must show the same structure (a layer whose q/k/v norm was not found would silently get
        # only half the noise).
        missing = [i for i, c in enumerate(per_layer_count) if c < max(per_layer_count)]
        shown = sorted(set([0, 1] + missing[:4]))
        report.extend(desc_by_layer[i] for i in shown if i < len(desc_by_layer))
        if targets:
            found_lists.append((list_name, targets, missing))
    if len(found_lists) == 1 and not found_lists[0][2]:
        return found_lists[0][1]
    found = "\n".join(report)
    if not found_lists:
        problem = "no norm-like module in any layer list feeds a Linear-like projection"
    elif len(found_lists) > 1:
        problem = f"several layer lists have norm -> projection structure: {[f[0] for f in found_lists]}"
    else:
        problem = (
            f"layers {found_lists[0][2]} of {found_lists[0][0]} have fewer norms feeding projections than the "
            "other layers"
        )
    raise AQNStructureError(
        f"AQN could not find its noise targets in {type(model).__name__}: {problem}. What was found "
        f"(hidden={hidden}):\n{found}\nAQN needs every decoder layer to have a "
        "bias-free norm whose output feeds the layer's input projections (q/k/v, gate/up)."
    )
