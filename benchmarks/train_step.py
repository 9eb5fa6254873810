"""One training step (forward + backward) of 4 Qwen2.5-7B-shaped decoder layers with LoRA r=32 on every linear.

    python benchmarks/train_step.py [--out-dir benchmarks/results] [--batch 8 --seq 2304 --steps 5]

Configs: ``nvfp4`` (NVFP4Linear base, our kernels, fastest path per matmul), ``bf16`` (frozen BF16
nn.Linear base), ``nvfp4-naive`` (NVFP4Linear with ``QERL_NVFP4_BACKEND=reference``: dequantize + matmul every
call, as the published QeRL code).
Gradient checkpointing on each layer (``torch.utils.checkpoint``, non-reentrant), sdpa attention, bf16.
The LoRA here is a plain ``base(x) + scale * (x @ Aᵀ) @ Bᵀ`` wrapper, identical for all three configs (the PEFT
LoRA layer for NVFP4Linear, qerl_trl/peft_lora.py, was not available when this was written); it adds the same
cost to every config, so the comparison isolates the frozen base. Writes ``<out-dir>/train_step-<gpu>.json``
rows ``{config, seconds, peak_gib}`` (seconds: median step time; peak_gib: torch peak allocated, weights included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._common import write_result  # noqa: E402
from qerl_trl.nvfp4.format import compute_global_scale  # noqa: E402
from qerl_trl.nvfp4.linear import NVFP4Linear  # noqa: E402

DEVICE = "cuda"


class LoRA(nn.Module):
    """``base(x) + (alpha/r) * B(A(x))`` with a frozen base and trainable bf16 A, B (PEFT's init: B = 0)."""

    def __init__(self, base: nn.Module, in_f: int, out_f: int, r: int = 32, alpha: int = 64):
        super().__init__()
        self.base = base
        self.A = nn.Parameter(torch.randn(r, in_f, device=DEVICE, dtype=torch.bfloat16) / in_f**0.5)
        self.B = nn.Parameter(torch.zeros(out_f, r, device=DEVICE, dtype=torch.bfloat16))
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + (x @ self.A.t()) @ self.B.t() * self.scale


def build(config, kind: str, n_layers: int, seed: int = 0):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    torch.manual_seed(seed)
    layers = nn.ModuleList()
    for i in range(n_layers):
        layer = Qwen2DecoderLayer(config, layer_idx=i).to(DEVICE, torch.bfloat16)
        for p in layer.parameters():
            p.requires_grad_(False)
        groups = {"self_attn": [("q_proj", "k_proj", "v_proj"), ("o_proj",)],
                  "mlp": [("gate_proj", "up_proj"), ("down_proj",)]}
        for parent_name, group_list in groups.items():
            parent = getattr(layer, parent_name)
            for group in group_list:
                lins = [getattr(parent, n) for n in group]
                for lin in lins:
                    nn.init.normal_(lin.weight, std=0.02)
                gs = compute_global_scale(*[lin.weight for lin in lins])  # shared, as vLLM fuses them
                for name, lin in zip(group, lins):
                    base = lin if kind == "bf16" else NVFP4Linear.from_linear(lin, global_scale=gs, name=name)
                    setattr(parent, name, LoRA(base, lin.in_features, lin.out_features))
        layers.append(layer)
    torch.cuda.empty_cache()
    return layers


def step(layers, rotary, hidden, pos):
    pe = rotary(hidden, pos)
    h = hidden
    for layer in layers:
        out = checkpoint(layer, h, position_ids=pos, position_embeddings=pe, use_reentrant=False)
        h = out[0] if isinstance(out, tuple) else out
    loss = h.float().pow(2).mean()
    loss.backward()
    return loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2304)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--configs", nargs="+", default=["bf16", "nvfp4", "nvfp4-naive"])
    args = ap.parse_args()
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    config = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                         num_hidden_layers=args.layers, max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, vocab_size=152064)
    config._attn_implementation = "sdpa"
    rotary = Qwen2RotaryEmbedding(config).to("cuda")
    pos = torch.arange(args.seq, device="cuda").unsqueeze(0).expand(args.batch, -1)
    rows = []
    for cfg in args.configs:
        os.environ["QERL_NVFP4_BACKEND"] = "reference" if cfg == "nvfp4-naive" else "auto"
        layers = build(config, "bf16" if cfg == "bf16" else "nvfp4", args.layers)
        torch.manual_seed(1)
        hidden = torch.randn(args.batch, args.seq, config.hidden_size, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):  # warm-up (autotuning, allocator)
            step(layers, rotary, hidden, pos)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            for p in layers.parameters():
                p.grad = None
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step(layers, rotary, hidden, pos)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1000)
        peak = torch.cuda.max_memory_allocated() / 2**30
        lora_grad = sum(float(p.grad.float().norm()) for p in layers.parameters() if p.grad is not None)
        rows.append(dict(config=cfg, seconds=round(statistics.median(times), 4), peak_gib=round(peak, 3),
                         step_times=[round(t, 4) for t in times], lora_grad_norm=round(lora_grad, 4),
                         tokens=args.batch * args.seq, layers=args.layers, lora_r=32, grad_checkpointing=True))
        print(rows[-1], flush=True)
        del layers, hidden
        torch.cuda.empty_cache()
    os.environ.pop("QERL_NVFP4_BACKEND", None)
    base = {r["config"]: r for r in rows}
    if "bf16" in base:
        for r in rows:
            r["vs_bf16_time"] = round(r["seconds"] / base["bf16"]["seconds"], 3)
    print("wrote", write_result("train_step", rows, args.out_dir))


if __name__ == "__main__":
    main()
