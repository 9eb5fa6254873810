"""Where one decode step's time goes inside a vLLM engine (issue #55 item 3).

``rollout.py --profile-batches 16 64`` runs :func:`profile_decode_step` in each engine after its timed batches;
the result lands in that batch's row as ``decode_profile``, and

    python benchmarks/decode_profile.py benchmarks/results/rollout-h100.json      # the README table

prints one line per profiled row.

Method. Two ``generate`` calls of the same prompts run under torch's profiler (CUPTI sees the kernels inside vLLM's
CUDA graphs), one decoding ``short`` tokens and one ``short + steps``. Everything a ``generate`` does once (the
prefill, request setup, the first and last steps) is in both, so their difference over ``steps`` is one decode
step alone. Per step, it reports the GPU time of each kernel category (:data:`CATEGORIES`, first match on the
kernel's name wins), the GPU's busy time (the union of kernel and copy intervals) and the span from the first to
the last GPU activity: ``span - busy`` is the time the GPU waits on the host between kernels and CUDA-graph
replays (``host_gap``). The FP4 GEMMs' achieved bandwidth is the step's FP4 weight bytes (packed E2M1 values and
their FP8 scales, from the model's config) over their time. The sampling parameters ask for the sampled token's
log-prob, as TRL's rollouts do.

Plain functions of event lists, so the categorisation and the arithmetic are tested on the CPU.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

#: kernel categories of a decode step, by kernel name (lowercase substrings; the first category that matches wins).
#: ``triton_poi`` / ``triton_red`` / ``triton_per`` are Inductor's fused kernels of the compiled model: in a decode
#: step they are the norms (AQN's float32 RMSNorm included), rotary embedding, SiLU-and-mul and residual adds.
#: The only BF16 GEMM of an NVFP4 decode step is the ``lm_head`` (the LoRA runs its own kernels), hence "logits".
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("lora", ("lora",)),
    ("fp4_gemm", ("humming", "marlin")),
    ("attention", ("flash", "attn", "reshape_and_cache", "paged", "mla")),
    ("norm_rope_act", ("rms_norm", "rmsnorm", "layernorm", "rotary", "rope", "act_and_mul", "silu", "triton_poi",
                       "triton_red", "triton_per")),
    ("logits_gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk", "gemv")),
    ("sampling", ("sort", "topk", "top_k", "softmax", "argmax", "gumbel", "exponential", "multinomial", "sampl",
                  "reduce_kernel", "scatter", "gather", "cumsum", "penalt", "logprob")),
    ("copy", ("memcpy", "memset")),
)
OTHER = "other"


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return OTHER


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: the time the GPU ran anything (overlapping streams once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def summarize(events: Sequence[tuple[str, float, float]]) -> dict[str, Any]:
    """``(name, start_us, end_us)`` GPU events of one ``generate`` -> microseconds by category, busy, span, and the
    time and call count per kernel name."""
    by_cat: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for name, start, end in events:
        by_cat[category(name)] = by_cat.get(category(name), 0.0) + (end - start)
        slot = by_name.setdefault(name, [0.0, 0])
        slot[0] += end - start
        slot[1] += 1
    span = (max(e for _, _, e in events) - min(s for _, s, _ in events)) if events else 0.0
    return {"us_by_category": by_cat, "busy_us": busy_us((s, e) for _, s, e in events), "span_us": span,
            "by_name": by_name}  # fmt: skip


def per_step(short: dict[str, Any], long: dict[str, Any], steps: int, fp4_weight_bytes: int | None = None) -> dict:
    """One decode step: (``long`` - ``short``) / ``steps`` of two :func:`summarize` results, in milliseconds."""
    cats = sorted(set(short["us_by_category"]) | set(long["us_by_category"]))
    ms = {c: (long["us_by_category"].get(c, 0.0) - short["us_by_category"].get(c, 0.0)) / steps / 1000 for c in cats}
    busy = (long["busy_us"] - short["busy_us"]) / steps / 1000
    span = (long["span_us"] - short["span_us"]) / steps / 1000
    out: dict[str, Any] = {
        "step_ms": round(span, 4),
        "gpu_busy_ms": round(busy, 4),
        "host_gap_ms": round(span - busy, 4),
        "ms_by_category": {c: round(v, 4) for c, v in sorted(ms.items(), key=lambda kv: -kv[1])},
    }
    if fp4_weight_bytes and ms.get("fp4_gemm", 0) > 0:
        out["fp4_weight_bytes"] = int(fp4_weight_bytes)
        out["fp4_gemm_gb_per_s"] = round(fp4_weight_bytes / (ms["fp4_gemm"] / 1000) / 1e9, 1)
    top = []
    for name, (us, calls) in long["by_name"].items():
        us0, calls0 = short["by_name"].get(name, (0.0, 0))
        top.append((name, (us - us0) / steps / 1000, (calls - calls0) / steps))
    top.sort(key=lambda t: -t[1])
    out["top_kernels"] = [{"kernel": n[:140], "category": category(n), "ms": round(m, 4), "calls": round(c, 2)}
                          for n, m, c in top[:15]]  # fmt: skip
    return out


def fp4_weight_bytes(config: Any) -> int:
    """The bytes one decode step reads of a Qwen2/Llama model's NVFP4 linears: half a byte per weight (E2M1) plus
    one FP8 scale per 16 weights, plus a float32 global scale per tensor (7 per layer)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    weights = h * q + 2 * h * kv + q * h + 2 * h * i + i * h
    return config.num_hidden_layers * (weights // 2 + weights // 16 + 7 * 4)


def gpu_events(prof: Any) -> list[tuple[str, float, float]]:
    """The GPU-side events (kernels, copies, sets) of a finished ``torch.profiler.profile``."""
    import torch

    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return out


def profile_decode_step(llm: Any, batch_prompts: list, request: Any, config: Any, short: int = 16,
                        steps: int = 96) -> dict:  # fmt: skip
    """Profile one decode step of ``batch_prompts`` in ``llm`` (an in-process vLLM engine): see the module doc."""
    import torch
    from vllm import SamplingParams

    results = []
    for tokens in (short, short + steps):
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=1.0, logprobs=0)
        llm.generate(batch_prompts, params, lora_request=request, use_tqdm=False)  # the same shapes, warm
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate(batch_prompts, params, lora_request=request, use_tqdm=False)
            torch.cuda.synchronize()
        results.append(summarize(gpu_events(prof)))
    out = per_step(results[0], results[1], steps, fp4_weight_bytes(config))
    out.update(batch=len(batch_prompts), steps=steps, short=short, method="difference of two profiled generates")
    return out


def table(rows: Iterable[dict]) -> str:
    """Markdown: one line per row with a ``decode_profile``."""
    cols = ("fp4_gemm", "lora", "attention", "norm_rope_act", "logits_gemm", "sampling", "copy", OTHER)
    lines = ["| arm | batch | step (ms) | GPU busy | host gap | " + " | ".join(cols) + " | FP4 GEMM GB/s |",
             "|" + "---|" * (len(cols) + 6)]
    for r in rows:
        p = r.get("decode_profile")
        if not p:
            continue
        arm = r["arm"] + (f"@{r['kernel']}" if r.get("kernel") else "")
        cells = [f"{p['ms_by_category'].get(c, 0.0):.3f}" for c in cols]
        lines.append(f"| {arm} | {r['batch']} | {p['step_ms']:.3f} | {p['gpu_busy_ms']:.3f} | {p['host_gap_ms']:.3f} | "
                     + " | ".join(cells) + f" | {p.get('fp4_gemm_gb_per_s', '–')} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            print(table(json.load(f)["rows"]))
