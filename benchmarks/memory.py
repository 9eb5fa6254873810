"""Memory of an NVFP4 base vs a BF16 base: resident bytes per quantized weight and forward+backward peak.

    python benchmarks/memory.py                       # GPU: 4 Qwen2.5-7B-shaped layers, batch 4 x seq 2048
    python benchmarks/memory.py --device cpu --tiny   # smoke run (tests/test_benchmarks_smoke.py)

Builds a stack of transformers ``Qwen2DecoderLayer`` s (hidden 3584, intermediate 18944, 28 heads, 4 kv heads,
head_dim 128; random weights), and for the ``nvfp4`` config converts every Linear to ``NVFP4Linear`` (q/k/v and
gate/up share a global scale). PEFT LoRA r=32 on all seven linears (BF16 adapters in both configs), gradient
checkpointing per layer (non-reentrant), bf16 activations. Per config it records

* ``bytes_per_quantized_weight``: storage bytes of packed codes + block scales + global scale over weights
  (asserted <= 0.5625 + 4/numel: 4 bits + one fp8 scale per 16 weights + the float32 global scale); 2.0 for bf16;
* ``fwd_bwd_peak_gib``: peak allocated memory (CUDA stats, weights included) over one forward+backward;
* ``kept_for_backward_mib``: memory allocated after forward minus before it, for one layer *without*
  checkpointing (what autograd keeps between forward and backward). The NVFP4 layer must keep no more than the
  BF16 layer plus less than the smallest dense 16-bit weight of the layer: a kept dequantized weight would
  exceed that. Also checked device-independently by inspecting every saved tensor (saved_tensors_hooks).

Writes ``<out-dir>/memory-<gpu>.json`` (envelope from ``benchmarks/_common.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._common import gpu_tag, result_envelope  # noqa: E402
from qerl_trl.nvfp4.format import compute_global_scale  # noqa: E402
from qerl_trl.nvfp4.linear import NVFP4Linear  # noqa: E402

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUPS = {"self_attn": [("q_proj", "k_proj", "v_proj"), ("o_proj",)], "mlp": [("gate_proj", "up_proj"), ("down_proj",)]}
GIB, MIB = 2**30, 2**20


def qwen_config(tiny: bool, n_layers: int):
    from transformers import Qwen2Config

    if tiny:
        return Qwen2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=n_layers, vocab_size=64, attn_implementation="sdpa")
    return Qwen2Config(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                       num_hidden_layers=n_layers, vocab_size=152064, attn_implementation="sdpa")


class Stack(nn.Module):
    """Decoder layers with per-layer gradient checkpointing (optional) and the rotary embedding."""

    def __init__(self, config, layers: nn.ModuleList, device) -> None:
        super().__init__()
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

        self.config = config
        self.layers = layers
        self.rotary = Qwen2RotaryEmbedding(config).to(device)
        self.checkpointing = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        pe = self.rotary(hidden, pos)
        for layer in self.layers:
            if self.checkpointing:
                out = checkpoint(layer, hidden, position_ids=pos, position_embeddings=pe, use_reentrant=False)
            else:
                out = layer(hidden, position_ids=pos, position_embeddings=pe)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden


def build(config, kind: str, n_layers: int, device, seed: int = 0) -> nn.ModuleList:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    torch.manual_seed(seed)
    layers = nn.ModuleList()
    for i in range(n_layers):
        layer = Qwen2DecoderLayer(config, layer_idx=i).to(device, torch.bfloat16).requires_grad_(False)
        if kind == "nvfp4":
            for parent_name, groups in GROUPS.items():
                parent = getattr(layer, parent_name)
                for group in groups:
                    lins = [getattr(parent, n) for n in group]
                    for lin in lins:
                        nn.init.normal_(lin.weight, std=0.02)
                    gs = compute_global_scale(*[lin.weight for lin in lins])
                    for name, lin in zip(group, lins):
                        setattr(parent, name, NVFP4Linear.from_linear(lin, global_scale=gs, name=f"{i}.{name}"))
        else:
            for name, lin in layer.named_modules():
                if isinstance(lin, nn.Linear):
                    nn.init.normal_(lin.weight, std=0.02)
        layers.append(layer)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return layers


def with_lora(stack: Stack, rank: int):
    from peft import LoraConfig, get_peft_model

    import qerl_trl  # noqa: F401  (registers the NVFP4 LoRA layer)

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LINEARS), init_lora_weights=True)
    return get_peft_model(stack, cfg, autocast_adapter_dtype=False)  # BF16 adapters for both configs


def quantized_bytes_per_weight(model: nn.Module) -> float:
    """Storage bytes behind each NVFP4Linear's tensors over its weight count; asserts the 0.5625 budget."""
    worst = 0.0
    n_layers = 0
    for name, m in model.named_modules():
        if not isinstance(m, NVFP4Linear):
            continue
        n_layers += 1
        numel = m.in_features * m.out_features
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in m.quantized}
        per_weight = sum(storages.values()) / numel
        budget = 0.5 + 1 / 16 + 4 / numel
        assert per_weight <= budget + 1e-12, f"{name}: {per_weight:.6f} bytes/weight > {budget:.6f}"
        assert all(t.dtype in (torch.uint8, torch.float8_e4m3fn, torch.float32) for t in m.quantized)
        worst = max(worst, per_weight)
    assert n_layers, "no NVFP4Linear found"
    return worst


def dense_linears_bytes(model: nn.Module) -> tuple[int, set[tuple[int, int]]]:
    """Smallest dense 16-bit weight size among the quantized linears, and their [out, in] shapes."""
    shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, NVFP4Linear)}
    return min(o * i * 2 for o, i in shapes), shapes


def saved_tensor_report(model: nn.Module, hidden: torch.Tensor) -> tuple[int, list[tuple]]:
    """Bytes of non-parameter tensors autograd saves for backward, and any saved dense weight-shaped ones."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, NVFP4Linear)}
    shapes |= {(i, o) for o, i in shapes}
    seen: dict[int, int] = {}
    suspicious = []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
            if t.is_floating_point() and t.dtype.itemsize >= 2 and tuple(t.shape) in shapes:
                suspicious.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(hidden)
    out.float().pow(2).mean().backward()
    return sum(seen.values()), suspicious


def measure(kind: str, args, device) -> dict:
    config = qwen_config(args.tiny, args.layers)
    h = config.hidden_size
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated() if on_cuda else 0
    model = with_lora(Stack(config, build(config, kind, args.layers, device), device), args.rank)
    model.train()
    weights_mem = (torch.cuda.memory_allocated() - base_mem) if on_cuda else 0
    row: dict = {"config": kind, "layers": args.layers, "batch": args.batch, "seq": args.seq, "lora_rank": args.rank}
    row["bytes_per_quantized_weight"] = quantized_bytes_per_weight(model) if kind == "nvfp4" else 2.0
    row["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    row["lora_dtype"] = str({p.dtype for p in model.parameters() if p.requires_grad})
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(args.batch, args.seq, h, generator=g).to(device, torch.bfloat16).requires_grad_(True)

    # forward + backward peak, with gradient checkpointing
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    out = model(hidden)
    out.float().pow(2).mean().backward()
    if on_cuda:
        torch.cuda.synchronize()
        row["fwd_bwd_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        row["weights_gib"] = weights_mem / GIB
    else:
        row["fwd_bwd_peak_gib"] = None
    model.zero_grad(set_to_none=True)
    hidden.grad = None
    del out

    # what one layer keeps between forward and backward without checkpointing
    single = model.base_model.model
    single.checkpointing = False
    keep_layers = single.layers
    single.layers = keep_layers[:1]
    small = hidden[:1].detach().requires_grad_(True)
    if on_cuda:
        # warm-up first: kernel autotuning and allocator/library workspaces on the first call are not "kept"
        model(small).float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        small.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = model(small)
        torch.cuda.synchronize()
        row["kept_for_backward_mib"] = (torch.cuda.memory_allocated() - before) / MIB
        out.float().pow(2).mean().backward()
        del out
    saved_bytes, suspicious = saved_tensor_report(model, small)
    row["saved_tensors_mib"] = saved_bytes / MIB
    assert not suspicious, f"{kind}: dense weight-shaped tensors saved for backward: {suspicious}"
    single.layers = keep_layers
    single.checkpointing = True
    del model
    if on_cuda:
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny layer shapes (smoke test)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4, tiny 2)")
    p.add_argument("--batch", type=int, default=None, help="default 4 (tiny 2)")
    p.add_argument("--seq", type=int, default=None, help="default 2048 (tiny 32)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--configs", default="bf16,nvfp4")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    args.layers = args.layers or (2 if args.tiny else 4)
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq = args.seq or (32 if args.tiny else 2048)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --tiny for a smoke run")

    rows = [measure(kind, args, device) for kind in args.configs.split(",")]
    by = {r["config"]: r for r in rows}
    if "bf16" in by and "nvfp4" in by:
        smallest_dense, _ = dense_linears_bytes(
            build(qwen_config(args.tiny, 1), "nvfp4", 1, torch.device("cpu")) if args.tiny else _shapes_only(args)
        )
        row = by["nvfp4"]
        row["smallest_dense_weight_mib"] = smallest_dense / MIB
        # a kept dequantized weight would add at least the smallest dense weight over the bf16 base
        for key in ("kept_for_backward_mib", "saved_tensors_mib"):
            if row.get(key) is not None and by["bf16"].get(key) is not None:
                extra = row[key] - by["bf16"][key]
                row[f"{key}_minus_bf16"] = extra
                assert extra < smallest_dense / MIB, f"nvfp4 keeps {extra:.1f} MiB more than bf16 ({key})"
    command = "python benchmarks/memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env = result_envelope("memory", rows, command.strip())
    os.makedirs(args.out_dir, exist_ok=True)
    tag = gpu_tag() if device.type == "cuda" else "cpu"
    path = os.path.join(args.out_dir, f"memory-{tag}.json")
    with open(path, "w") as f:
        json.dump(env, f, indent=1)
    print(json.dumps(rows, indent=1))
    print("wrote", path)
    return env


class _shapes_only(nn.Module):
    """The quantized linears' shapes of one full-size layer, without allocating it (meta tensors)."""

    def __init__(self, args) -> None:
        super().__init__()
        config = qwen_config(False, 1)
        h, i = config.hidden_size, config.intermediate_size
        kv = config.num_key_value_heads * (h // config.num_attention_heads)
        shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
        self.lins = nn.ModuleList(NVFP4Linear(k, n, device="meta") for n, k in shapes)


if __name__ == "__main__":
    main()
