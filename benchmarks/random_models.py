"""Qwen2.5- and Qwen3-MoE-shaped checkpoints with random weights, for benchmarks and GPU tests, made without the Hub.

The GPU machines cannot reach the Hub, and a speed or memory benchmark only needs the real *shapes*: this module
writes checkpoints whose architecture is exactly Qwen2.5-{1.5B,7B,14B,32B}-Instruct's or Qwen3-30B-A3B's (a
mixture-of-experts decoder: 128 experts, 8 active) and whose weights are random, plus a tokenizer built in code.

* :func:`write_bf16_checkpoint`: a plain bf16 checkpoint (``save_pretrained``), the input of NVFP4Config.
* :func:`write_nvfp4_checkpoint`: a compressed-tensors NVFP4A16 checkpoint written *directly*, one decoder
  layer at a time, in the layout ``model.save_pretrained`` writes after loading with ``NVFP4Config`` (same
  tensor names, dtypes, shapes and ``quantization_config``), so ``qerl_trl.load_nvfp4`` loads it packed and
  vLLM serves it. No 16-bit copy of a decoder Linear is ever materialised (a 32B bf16 checkpoint, 65 GB,
  would not fit the GPU machine's disk; the NVFP4 one is ~18 GB): each Linear is drawn as Gaussian row chunks
  quantized with :mod:`qerl_trl.nvfp4.format`, so it equals, byte for byte, what the library would write for
  the bf16 weight those chunks form (``tests/test_random_models.py`` checks that). A mixture-of-experts model's
  routed experts (transformers' fused 3-D ``gate_up_proj`` / ``down_proj``) are written per expert as
  llm-compressor writes them for vLLM (``mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``, gate and up
  under one global scale), and the router (``mlp.gate``) stays bf16, in ``ignore`` as ``re:.*mlp.gate$``.
* :func:`write_tokenizer`: byte-level BPE without merges (one token per byte), padded to the model's vocab so
  every id the model can sample decodes; :func:`make_prompts` makes prompts of an exact token count for it.

CLI: ``python benchmarks/random_models.py {bf16,nvfp4} --size qwen2.5-7b --out DIR [--device cuda]`` (``--size
qwen3-30b-a3b``: NVFP4 only, about 18 GB, written tensor by tensor with no 16-bit copy of the experts).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import itertools
import json
import os
import random
import re
import shutil
import string
import sys
import zlib
from collections.abc import Iterator
from typing import Any

import torch

#: Architecture of the released Qwen2.5-*-Instruct ``config.json`` files (the models the README and recipes use).
#: The base (non-Instruct) 7B/14B/32B checkpoints differ only in ``max_position_embeddings`` (131072), and the
#: 14B/32B base ones in ``rms_norm_eps`` (1e-5); neither changes a weight shape.
QWEN25_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": {
        "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    },
    "qwen2.5-7b": {
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    },
    "qwen2.5-14b": {
        "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40,
        "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    },
    "qwen2.5-32b": {
        "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40,
        "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    },
}

#: Architecture of Qwen3-30B-A3B's ``config.json`` (issue #54's MoE shape): every layer sparse, 128 routed experts of
#: width 768, 8 active per token, no shared expert; 30.5B parameters, 3.3B active.
QWEN3_MOE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "tie_word_embeddings": False, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    },
}
#: every size this module writes
SIZES = (*QWEN25_SHAPES, *QWEN3_MOE_SHAPES)

#: The tokenizer's only special token: eos, pad (and the config's bos, as in Qwen2.5) are all this one.
EOS_TOKEN = "<|endoftext|>"
#: Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer rebuilds itself with it; see write_tokenizer).
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
#: Shard sizes: the NVFP4 writer holds one shard in host memory before writing it.
NVFP4_MAX_SHARD_BYTES = 2 * 1024**3
BF16_MAX_SHARD_SIZE = "5GB"


# ---------------------------------------------------------------------------------------------------- config
def eos_token_id(vocab_size: int) -> int:
    """Id of ``<|endoftext|>`` in :func:`write_tokenizer`'s vocab: the last one."""
    return vocab_size - 1


def _shaped_config(config_class: Any, shapes: dict[str, dict[str, Any]], family: str, size: str,
                   overrides: dict[str, Any], **defaults: Any):
    """``config_class`` with ``shapes[size]``, ``overrides`` on top, bf16, and bos/eos/pad set to
    :func:`write_tokenizer`'s ``<|endoftext|>`` id (the last id of the possibly overridden ``vocab_size``)."""
    key = size.lower()
    if key not in shapes:
        raise ValueError(f"unknown {family} size {size!r}; known sizes: {', '.join(shapes)}")
    kw: dict[str, Any] = {**shapes[key], **overrides}
    eos = eos_token_id(kw["vocab_size"])
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        kw.setdefault(name, eos)
    kw.setdefault("dtype", torch.bfloat16)
    for name, value in defaults.items():
        kw.setdefault(name, value)
    return config_class(**kw)


def qwen25_config(size: str, **overrides: Any):
    """A ``Qwen2Config`` with Qwen2.5-``size``'s architecture (``QWEN25_SHAPES``), bf16, and bos/eos/pad set to
    :func:`write_tokenizer`'s ``<|endoftext|>`` id (the last id of the possibly overridden ``vocab_size``).

    ``overrides`` replace any field (tests shrink the shapes this way). Unknown sizes raise a ValueError.
    """
    from transformers import Qwen2Config

    return _shaped_config(Qwen2Config, QWEN25_SHAPES, "Qwen2.5", size, overrides,
                          architectures=["Qwen2ForCausalLM"], use_sliding_window=False)  # fmt: skip


def qwen3_moe_config(size: str, **overrides: Any):
    """A ``Qwen3MoeConfig`` with ``size``'s architecture (``QWEN3_MOE_SHAPES``), as :func:`qwen25_config` builds
    a Qwen2.5 one (bf16, bos/eos/pad on the tokenizer's ``<|endoftext|>``, ``overrides`` replace any field)."""
    from transformers import Qwen3MoeConfig

    return _shaped_config(Qwen3MoeConfig, QWEN3_MOE_SHAPES, "Qwen3-MoE", size, overrides,
                          architectures=["Qwen3MoeForCausalLM"])  # fmt: skip


def model_config(size: str, **overrides: Any):
    """The config of any size in :data:`SIZES`."""
    if size.lower() in QWEN3_MOE_SHAPES:
        return qwen3_moe_config(size, **overrides)
    if size.lower() in QWEN25_SHAPES:
        return qwen25_config(size, **overrides)
    raise ValueError(f"unknown model size {size!r}; known sizes: {', '.join(SIZES)}")


def _resolve_config(size_or_config: Any):
    if isinstance(size_or_config, str):
        return model_config(size_or_config)
    config = copy.deepcopy(size_or_config)
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError("pass a config without quantization_config (this writes a fresh checkpoint)")
    config.dtype = torch.bfloat16
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the tokenizer's <|endoftext|> where unset
        if getattr(config, name, None) is None:
            setattr(config, name, eos_token_id(config.vocab_size))
    return config


# ---------------------------------------------------------------------------------------------------- tokenizer
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which ByteLevel (pre-tokenizer and decoder) uses."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _byte_level_vocab(vocab_size: int) -> dict[str, int]:
    """Ids 0..255: byte b is token b; then distinct 2- and 3-character filler strings; ``<|endoftext|>`` last."""
    b2u = _byte_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    alphabet = [b2u[b] for b in range(256)]
    fillers = itertools.chain(
        ("".join(p) for p in itertools.product(alphabet, repeat=2)),
        ("".join(p) for p in itertools.product(alphabet, repeat=3)),
    )
    for s in itertools.islice(fillers, vocab_size - 1 - 256):
        vocab[s] = len(vocab)
    vocab[EOS_TOKEN] = eos_token_id(vocab_size)
    return vocab


def write_tokenizer(path: str, vocab_size: int, model_max_length: int = 32768) -> None:
    """Save a byte-level BPE tokenizer with no merges and exactly ``vocab_size`` ids to ``path``.

    Every byte is one token (id = byte value), so an ASCII text of N characters is N tokens. Ids 256 up to
    ``vocab_size - 2`` are filler strings that encoding never produces (no merges) but that decode without
    error, so any id a random model samples decodes; ``<|endoftext|>`` (eos and pad; no bos is added) is the
    last id. Why the pieces are Qwen2's (NFC normalizer, its split regex, ByteLevel): ``AutoTokenizer`` maps
    ``model_type: qwen2`` to ``Qwen2Tokenizer``, which ignores the saved pipeline and rebuilds itself from vocab
    + merges with exactly those pieces. A byte-level BPE survives that rebuild unchanged; a word-level one
    would silently encode prompts to nothing. The saved files load the same with or without a qwen2
    ``config.json`` beside them.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes + {EOS_TOKEN}), got {vocab_size}")
    tok = Tokenizer(
        models.BPE(
            vocab=_byte_level_vocab(vocab_size), merges=[], dropout=None, unk_token=None,
            continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, bos_token=None, unk_token=None,
        model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )
    if len(fast) != vocab_size:  # pragma: no cover - guards the construction above
        raise AssertionError(f"tokenizer has {len(fast)} ids, expected {vocab_size}")
    fast.save_pretrained(path)


_WORD_CHARS = string.ascii_lowercase
_PUNCT = ".,;:!?"


def make_prompts(n: int, num_tokens: int, seed: int = 0, tokenizer: Any = None) -> list[str]:
    """``n`` distinct plain-text prompts (printable ASCII words, no special tokens) of ``num_tokens`` tokens each.

    With :func:`write_tokenizer`'s tokenizer one character is one token, so each prompt has exactly
    ``num_tokens`` characters. When ``tokenizer`` is given, each prompt is encoded as vLLM encodes prompts
    (``tokenizer(prompt)``, special tokens on) and an AssertionError is raised unless it is ``num_tokens`` ids.
    """
    if n < 0 or num_tokens < 1:
        raise ValueError(f"need n >= 0 and num_tokens >= 1, got n={n}, num_tokens={num_tokens}")
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        parts: list[str] = []
        length = -1  # len(" ".join(parts))
        while length < num_tokens:
            word = "".join(rng.choice(_WORD_CHARS) for _ in range(rng.randint(2, 8)))
            if rng.random() < 0.1:
                word += rng.choice(_PUNCT)
            if rng.random() < 0.05:
                word = word.capitalize()
            parts.append(word)
            length += len(word) + 1
        text = " ".join(parts)[:num_tokens]
        if text[-1] == " ":  # no trailing whitespace (some pipelines strip it)
            text = text[:-1] + rng.choice(_WORD_CHARS)
        if tokenizer is not None:
            count = len(tokenizer(text)["input_ids"])
            if count != num_tokens:
                raise AssertionError(
                    f"prompt {text[:40]!r}... encodes to {count} tokens, not {num_tokens}: make_prompts expects "
                    "write_tokenizer's one-token-per-byte tokenizer"
                )
        prompts.append(text)
    return prompts


# ---------------------------------------------------------------------------------------------------- shared helpers
@contextlib.contextmanager
def _staged(path: str) -> Iterator[str]:
    """A fresh sibling directory to write a checkpoint into. On success its files move into ``path``, config.json
    last (its presence means complete); on any error it is deleted and ``path`` is left as it was."""
    tmp = f"{os.path.abspath(path).rstrip(os.sep)}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not os.path.exists(path):
        os.rename(tmp, path)
        return
    for name in sorted(os.listdir(tmp), key=lambda f: f == "config.json"):
        os.replace(os.path.join(tmp, name), os.path.join(path, name))
    os.rmdir(tmp)


def _save_generation_config(config, path: str) -> None:
    """Plain generation config (token ids only, no sampling defaults, which vLLM would apply to every request)."""
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(config).save_pretrained(path)


def _save_model_files(config, path: str) -> None:
    """Everything but the weights: generation_config.json, the tokenizer and config.json."""
    _save_generation_config(config, path)
    write_tokenizer(path, config.vocab_size, model_max_length=config.max_position_embeddings)
    config.save_pretrained(path)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- bf16
def write_bf16_checkpoint(path: str, size_or_config: Any, device: str = "cpu", seed: int = 0) -> str:
    """A random bf16 Qwen2.5-shaped checkpoint at ``path`` (sharded safetensors + tokenizer); returns ``path``.

    The model is built by ``from_config`` directly on ``device`` (a 7B model is initialised on the GPU, not in
    host memory), with transformers' own init (normal, std ``initializer_range``) and norm weights 1. Nothing
    is done when ``path/config.json`` exists (cache within a machine; delete the directory to rebuild).
    """
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = _resolve_config(size_or_config)
    dev = torch.device(device)
    torch.manual_seed(seed)
    with _staged(path) as tmp:
        with dev:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
        model.save_pretrained(tmp, max_shard_size=BF16_MAX_SHARD_SIZE)
        del model
        _free(dev)
        write_tokenizer(tmp, config.vocab_size, model_max_length=config.max_position_embeddings)
    return path


def write_config_dir(path: str, size_or_config: Any) -> str:
    """config.json (bf16), generation_config.json and the tokenizer of a Qwen2.5-shaped model, and no weights: what
    vLLM's ``load_format="dummy"`` needs to serve it with random weights. This is how a BF16 model too large for the
    GPU machine's disk (32B, 65 GB) is served. Returns ``path``; nothing is done when ``path/config.json`` exists."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = _resolve_config(size_or_config)
    with _staged(path) as tmp:
        _save_model_files(config, tmp)
    return path


# ---------------------------------------------------------------------------------------------------- nvfp4
def _chunk_rows(in_features: int, device: torch.device) -> int:
    """Rows drawn (and quantized) at once: ~4M elements on CPU, ~32M on a GPU."""
    elements = (1 << 25) if device.type == "cuda" else (1 << 22)
    return max(1, elements // max(1, in_features))


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)


def _gaussian_chunks(
    name: str, shape: tuple[int, ...], std: float, seed: int, device: torch.device
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first_row, chunk)`` row chunks of a ``N(0, std^2)`` bf16 tensor, deterministic in (seed, name, device type).

    Rows come from one generator seeded from ``(seed, name)``, so drawing again gives the same chunks; the
    whole tensor is never held on ``device`` at once.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(_tensor_seed(seed, name))
    inner = tuple(shape[1:])
    step = _chunk_rows(int(torch.Size(inner).numel()), device)
    for r0 in range(0, shape[0], step):
        rows = min(step, shape[0] - r0)
        x = torch.randn((rows, *inner), generator=gen, device=device, dtype=torch.float32)
        yield r0, x.mul_(std).to(torch.bfloat16)


def _random_dense(name: str, shape: tuple[int, ...], std: float, seed: int, device: torch.device) -> torch.Tensor:
    """The whole bf16 tensor on the CPU, filled chunk by chunk (no second host copy)."""
    out = torch.empty(shape, dtype=torch.bfloat16)
    for r0, chunk in _gaussian_chunks(name, shape, std, seed, device):
        out[r0 : r0 + chunk.shape[0]].copy_(chunk)
    return out


def random_bf16_tensor(
    name: str, shape: tuple[int, ...], std: float, seed: int = 0, device: str = "cpu"
) -> torch.Tensor:
    """The whole tensor :func:`write_nvfp4_checkpoint` draws for ``name`` (for a Linear: before quantizing).

    For tests, which quantize it with the library and compare bytes; the writer never builds it for a Linear.
    """
    return _random_dense(name, tuple(shape), std, seed, torch.device(device))


def _quantized_group(
    members: list[tuple[str, int, int]], std: float, seed: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """NVFP4 tensors (on the CPU) of one fused group ``[(module, out, in), ...]`` with one shared global scale.

    Two passes over the same deterministic chunks: the first takes the group's amax chunk by chunk, the second
    quantizes each chunk with :func:`qerl_trl.nvfp4.format.quantize` under the global scale that
    :func:`~qerl_trl.nvfp4.format.compute_global_scale` gives for the chunk amaxes, which is exactly the scale
    it gives for the whole bf16 tensors (a max is exact). Rows are independent given the global scale, so the
    result equals the library's quantization of the concatenated weights, which never exist here.
    """
    from qerl_trl.nvfp4 import format as nvfp4

    amaxes = [
        chunk.abs().amax().reshape(1)
        for name, out_f, in_f in members
        for _, chunk in _gaussian_chunks(name + ".weight", (out_f, in_f), std, seed, device)
    ]
    global_scale = nvfp4.compute_global_scale(torch.cat(amaxes), name=members[0][0] + ".weight")
    tensors: dict[str, torch.Tensor] = {}
    for name, out_f, in_f in members:
        packed = torch.empty(out_f, in_f // 2, dtype=torch.uint8)
        scales = torch.empty(out_f, in_f // nvfp4.BLOCK_SIZE, dtype=torch.float8_e4m3fn)
        for r0, chunk in _gaussian_chunks(name + ".weight", (out_f, in_f), std, seed, device):
            q = nvfp4.quantize(chunk, global_scale=global_scale, name=name + ".weight")
            packed[r0 : r0 + chunk.shape[0]].copy_(q.weight_packed)
            scales[r0 : r0 + chunk.shape[0]].copy_(q.weight_scale)
            del chunk, q
        tensors[name + ".weight_packed"] = packed
        tensors[name + ".weight_scale"] = scales
        tensors[name + ".weight_global_scale"] = global_scale.cpu().clone()
    return tensors


_LAYER_RE = re.compile(r"^(.*?layers\.\d+)\.")


def expert_groups(module_name: str, param: str, shape: tuple[int, ...]) -> list[list[tuple[str, int, int]]]:
    """The per-expert NVFP4 groups ``[[(module, out, in), ...], ...]`` that hold one fused 3-D expert parameter, named
    as llm-compressor saves a MoE for vLLM: ``gate_up_proj`` -> each expert's ``gate_proj`` and ``up_proj`` (one
    group: vLLM serves them as one matrix under one global scale), ``down_proj`` -> each expert's ``down_proj``."""
    if param == "gate_up_proj":
        experts, two_width, hidden = shape
        width = two_width // 2
        return [[(f"{module_name}.{e}.gate_proj", width, hidden), (f"{module_name}.{e}.up_proj", width, hidden)]
                for e in range(experts)]  # fmt: skip
    if param == "down_proj":
        experts, hidden, width = shape
        return [[(f"{module_name}.{e}.down_proj", hidden, width)] for e in range(experts)]
    raise ValueError(f"{module_name}.{param} is not a fused expert parameter (gate_up_proj or down_proj)")


class _Layout:
    """What the checkpoint holds, read off a meta-device model and the library's own conversion plan.

    ``qerl_trl.quantizer.conversion.plan_conversion`` (what ``NVFP4Config`` runs) gives the same quantized
    modules, fused groups and ``ignore`` list as the library's own save; routed experts are per-expert groups
    (:func:`expert_groups`) and their routers go in ``ignore``. ``units`` are the tensors generated and sharded
    together, in checkpoint order: embeddings, one unit per decoder layer, final norm, lm_head.
    """

    def __init__(self, config) -> None:
        from transformers import AutoModelForCausalLM

        from qerl_trl.quantizer.config import DEFAULT_FUSED_GROUPS
        from qerl_trl.quantizer.conversion import plan_conversion
        from qerl_trl.quantizer.moe import ROUTER_IGNORE, beside_experts, check_expert_layout, fused_experts

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        experts = fused_experts(model)
        check_expert_layout(model, experts)
        plan = functools.partial(plan_conversion, model, None, DEFAULT_FUSED_GROUPS)
        self.plan = beside_experts(model, experts, plan)
        self.ignore = sorted(self.plan.kept) + ([ROUTER_IGNORE] if experts else [])  # as quantize_model writes it
        kept = list(self.plan.kept)  # module -> why it stays 16-bit
        if len(kept) != 1 or model.get_submodule(kept[0]) is not model.get_output_embeddings():
            raise ValueError(
                f"every decoder Linear needs in_features divisible by 16; these would stay 16-bit: {self.plan.kept}"
            )
        shapes = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if n in self.plan.groups}
        tied = bool(config.get_text_config(decoder=True).tie_word_embeddings)
        out_emb = kept[0] + ".weight"
        self.units: dict[str, list[tuple[str, Any]]] = {}
        done: set[tuple[str, ...]] = set()
        for pname, p in model.named_parameters(remove_duplicate=False):
            if tied and pname == out_emb:
                continue  # saved once, as the input embedding
            module, _, leaf = pname.rpartition(".")
            m = _LAYER_RE.match(pname)
            unit = self.units.setdefault(m.group(1) if m else pname, [])
            if module in experts:
                unit.extend(("group", group) for group in expert_groups(module, leaf, tuple(p.shape)))
            elif module in self.plan.groups and pname.endswith(".weight"):
                group = self.plan.groups[module]
                if group not in done:
                    done.add(group)
                    unit.append(("group", [(n, *shapes[n]) for n in group]))
            else:
                unit.append(("dense", (pname, tuple(p.shape))))
        del model

    def nbytes(self, unit: str) -> int:
        """Bytes of one unit's tensors (computed from shapes, nothing is generated)."""
        total = 0
        for kind, spec in self.units[unit]:
            if kind == "dense":
                total += 2 * int(torch.Size(spec[1]).numel())
            else:
                total += sum(out_f * in_f // 2 + out_f * in_f // 16 + 4 for _, out_f, in_f in spec)
        return total

    def tensors(self, unit: str, std: float, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
        """One unit's tensors, on the CPU."""
        out: dict[str, torch.Tensor] = {}
        for kind, spec in self.units[unit]:
            if kind == "group":
                out.update(_quantized_group(spec, std, seed, device))
                continue
            name, shape = spec
            if name.endswith("norm.weight"):
                out[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:  # embeddings, lm_head, q/k/v biases, routers
                out[name] = _random_dense(name, shape, std, seed, device)
        return out


def write_nvfp4_checkpoint(
    path: str,
    size_or_config: Any,
    device: str = "cpu",
    seed: int = 0,
    weight_std: float = 0.02,
    max_shard_bytes: int = NVFP4_MAX_SHARD_BYTES,
    progress: bool = False,
) -> str:
    """A random compressed-tensors NVFP4A16 checkpoint at ``path``, written directly; returns ``path``.

    Layout: what ``model.save_pretrained`` writes after ``from_pretrained(..., NVFP4Config())``: per decoder
    Linear ``weight_packed`` uint8 [out, in/2], ``weight_scale`` float8_e4m3fn [out, in/16] and
    ``weight_global_scale`` float32 [1] (one value shared by q/k/v, one by gate/up); q/k/v biases, norms (1.0),
    embeddings and an untied ``lm_head`` in bf16; the library's ``quantization_config`` (``ignore:
    ["lm_head"]``). A mixture-of-experts config's routed experts are written per expert (:func:`expert_groups`),
    its routers in bf16 and in ``ignore`` (``re:.*mlp.gate$``). Each Linear is the NVFP4 rounding of a
    ``N(0, weight_std^2)`` bf16 weight drawn in row chunks on ``device`` (:func:`_quantized_group`), so dequantized
    weights have std ~``weight_std`` and realistic code and scale statistics; biases and embeddings are
    ``N(0, weight_std^2)``.

    Streams: one decoder layer is generated at a time and written in shards of at most ``max_shard_bytes`` (a
    larger single unit gets its own shard) with ``model.safetensors.index.json`` (one shard: plain
    ``model.safetensors``), so host memory stays around two shards' worth even at 32B. Also writes
    generation_config.json, the tokenizer and, last, config.json; nothing is done when ``path/config.json``
    exists. Use ``device="cuda"`` for real sizes (a 2-core CPU does ~30M weights/s). The same seed gives
    different weights on CPU and GPU (different random generators).
    """
    from safetensors.torch import save_file

    from qerl_trl.quantizer.checkpoint import compressed_tensors_config

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = _resolve_config(size_or_config)
    dev = torch.device(device)
    layout = _Layout(config)

    # plan the shards from sizes alone, so file names (model-0000i-of-0000n) are known before writing
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for unit in layout.units:
        size = layout.nbytes(unit)
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(unit)
        shard_bytes += size
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    with _staged(path) as tmp:
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(layout.units), desc=f"NVFP4 checkpoint ({n} shard(s))", unit="unit")
        weight_map: dict[str, str] = {}
        total_size = total_params = 0
        for fname, units in zip(files, shards):
            tensors: dict[str, torch.Tensor] = {}
            for unit in units:
                tensors.update(layout.tensors(unit, weight_std, seed, dev))
                if bar is not None:
                    bar.update(1)
            for name, t in tensors.items():
                weight_map[name] = fname
                total_size += t.numel() * t.element_size()
                total_params += t.numel()
            save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
            del tensors
            _free(dev)
        if bar is not None:
            bar.close()
        if n > 1:
            index = {
                "metadata": {"total_parameters": total_params, "total_size": total_size},
                "weight_map": dict(sorted(weight_map.items())),
            }
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
                f.write("\n")
        config.quantization_config = compressed_tensors_config(layout.ignore)
        _save_model_files(config, tmp)
    return path


# ---------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> str:
    """``python benchmarks/random_models.py {bf16,nvfp4} --size qwen2.5-7b --out DIR [--device cuda]``."""
    parser = argparse.ArgumentParser(
        description="Write a Qwen2.5-shaped checkpoint with random weights (no Hugging Face Hub access).",
    )
    parser.add_argument("kind", choices=("bf16", "nvfp4"), help="plain bf16, or compressed-tensors NVFP4A16")
    parser.add_argument("--size", default="qwen2.5-7b", choices=list(SIZES))
    parser.add_argument("--out", required=True, help="output directory (nothing is done if it holds config.json)")
    parser.add_argument("--device", default="cpu", help="where weights are generated (cuda for real sizes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-std", type=float, default=0.02, help="nvfp4: std of the (dequantized) weights")
    args = parser.parse_args(argv)
    if args.kind == "bf16":
        out = write_bf16_checkpoint(args.out, args.size, device=args.device, seed=args.seed)
    else:
        out = write_nvfp4_checkpoint(
            args.out, args.size, device=args.device, seed=args.seed, weight_std=args.weight_std, progress=True
        )
    print(out)
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
