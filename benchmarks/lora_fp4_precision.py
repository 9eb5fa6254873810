"""What serving the LoRA's A (or B) in NVFP4 would do to the rollout policy: log-prob drift on a trained adapter.

    python benchmarks/lora_fp4_precision.py --adapter outputs/demo [--out-dir benchmarks/results]
        # -> lora_fp4_precision-cpu.json (on CPU: SmolLM2-135M, the demo's NVFP4 base and trained LoRA)

Why: the rollout's LoRA costs 28-31% over Humming without one at batch 1-64 (issue #38), most of it the shrink
``x A^T`` (7056 shrinks took 55 ms against 238 ms of Humming GEMMs at batch 16, 2bfc0a4). If A were stored in
NVFP4 as extra output channels of the base weight (one GEMM gives ``y`` and ``x A^T``), the shrink would cost a
few percent more FP4 bytes instead of a kernel launch per linear. The trainer keeps A in bf16, so the rollouts'
policy would drift from the trained one. This measures that drift before any kernel is written.

Variants of the adapter (the base is the same NVFP4 model in every variant):

* ``lora_bf16``: the adapter as trained (the reference);
* ``a_jitter``: every ``lora_A`` times ``1 + 1e-3 * N(0, 1)``, a change far below FP4's: the control. In bf16 any
  change of the weights moves the log-probs by the rounding of a whole forward, so a variant means something only
  where it differs from this one (``--dtype float32`` removes most of that floor);
* ``a_fp4``: every ``lora_A`` quantized to NVFP4 and back, one global scale per row (Humming's per-channel second
  scale allows that: each row of A is an output channel of the extended weight);
* ``a_fp4x2``: every ``lora_A`` as two NVFP4 terms, ``Q(A) + Q(A - Q(A))``: twice the extra output channels, and
  the quantization error of the first term quantized again;
* ``b_fp4``: every ``lora_B`` likewise (per row of B: per output channel);
* ``ab_fp4``: both;
* ``no_lora``: the adapter off (how far the LoRA moves the policy: the scale against which the drift is small
  or not).

Sequences: held-out prompts of the demo's task, each with completions sampled at temperature 1 from the reference
policy. For each variant, over the completion tokens: the mean and the 99th percentile of |log p - log p_ref|,
the mean of (log p - log p_ref), and the fraction of tokens whose greedy choice differs from the reference's. The
colocate check holds trainer-vs-vLLM log-probs of SmolLM2 to 0.05 nats/token (0.03-0.04 measured there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

VARIANTS = ("lora_bf16", "a_jitter", "a_fp4", "a_fp4x2", "b_fp4", "ab_fp4", "no_lora")


def fp4_roundtrip_rows(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] quantized to NVFP4 and back, each row with its own global scale (K padded to 16)."""
    from qerl_trl.nvfp4.format import BLOCK_SIZE, dequantize, quantize

    out_f, in_f = weight.shape
    pad = -in_f % BLOCK_SIZE
    w = torch.nn.functional.pad(weight.detach().to(torch.bfloat16), (0, pad))
    rows = [dequantize(*_fields(quantize(w[i : i + 1])), dtype=torch.float32) for i in range(out_f)]
    return torch.cat(rows)[:, :in_f].to(weight.dtype)


def _fields(q) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.weight_packed, q.weight_scale, q.weight_global_scale


def completion_logprobs(model, input_ids: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the completion tokens ``[batch, len]``, and the greedy choices at those positions."""
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[:, prompt_len - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    target = input_ids[:, prompt_len:]
    return logp.gather(-1, target.unsqueeze(-1)).squeeze(-1), logits.argmax(-1)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", required=True, help="a trained PEFT LoRA directory (the demo's output)")
    ap.add_argument("--base", default=None, help="its NVFP4 base (default: the adapter config's)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the model's compute dtype (the adapter's weights are cast to it)")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    a = ap.parse_args(argv)

    from peft import PeftModel
    from transformers import AutoTokenizer

    from benchmarks._common import git_commit, write_result
    from qerl_trl.quantizer.checkpoint import load_nvfp4  # importing qerl_trl registers its LoRA layer with PEFT
    from qerl_trl.demo import TASK

    with open(os.path.join(a.adapter, "adapter_config.json")) as f:
        base = a.base or json.load(f)["base_model_name_or_path"]
    torch.manual_seed(a.seed)
    tok = AutoTokenizer.from_pretrained(a.adapter)
    dtype = getattr(torch, a.dtype)
    model = load_nvfp4(base, dtype=dtype)
    model = PeftModel.from_pretrained(model, a.adapter).eval().to(dtype)
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}

    # the same prompt length for every prompt of the batch: left-truncated held-out prompts, no padding to mask
    problems = TASK.problems(a.prompts, seed=a.seed + 10_000)
    ids = [tok(TASK.prompt(p), add_special_tokens=False)["input_ids"] for p in problems]
    prompt_len = min(len(x) for x in ids)
    prompts = torch.tensor([x[-prompt_len:] for x in ids]).repeat_interleave(a.samples, dim=0)
    t0 = time.time()
    with torch.no_grad():
        seqs = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                              pad_token_id=tok.eos_token_id)  # fmt: skip
    print(f"sampled {tuple(seqs.shape)} in {time.time() - t0:.0f} s", flush=True)

    def set_variant(name: str) -> None:
        for n, p in model.named_parameters():
            if "lora_" not in n:
                continue
            w = trained[n]
            if (name in ("a_fp4", "ab_fp4") and "lora_A" in n) or (name in ("b_fp4", "ab_fp4") and "lora_B" in n):
                w = fp4_roundtrip_rows(w)
            elif name == "a_jitter" and "lora_A" in n:
                gen = torch.Generator().manual_seed(a.seed)
                w = w * (1 + 1e-3 * torch.randn(w.shape, generator=gen)).to(w.dtype)
            elif name == "a_fp4x2" and "lora_A" in n:
                first = fp4_roundtrip_rows(w)
                w = first + fp4_roundtrip_rows(w - first)
            p.data.copy_(w)

    results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in VARIANTS:
        set_variant(name)
        if name == "no_lora":
            with model.disable_adapter():
                results[name] = completion_logprobs(model, seqs, prompt_len)
        else:
            results[name] = completion_logprobs(model, seqs, prompt_len)
    set_variant("lora_bf16")
    ref_lp, ref_greedy = results["lora_bf16"]
    rel_err = {}
    for kind in ("lora_A", "lora_B", "lora_A x2"):
        weights = [w for n, w in trained.items() if kind.split()[0] in n]
        if kind.endswith("x2"):
            err = [w - fp4_roundtrip_rows(w) for w in weights]
            err = [e - fp4_roundtrip_rows(e) for e in err]
        else:
            err = [w - fp4_roundtrip_rows(w) for w in weights]
        num = sum(float(e.float().norm() ** 2) for e in err)
        den = sum(float(w.float().norm() ** 2) for w in weights)
        rel_err[kind] = round((num / den) ** 0.5, 4) if den else None
    rows = []
    for name in VARIANTS:
        lp, greedy = results[name]
        diff = lp - ref_lp
        rows.append(dict(
            variant=name, tokens=int(diff.numel()), mean_abs_logprob_diff=round(float(diff.abs().mean()), 5),
            p99_abs_logprob_diff=round(float(diff.abs().flatten().quantile(0.99)), 5),
            mean_logprob_diff=round(float(diff.mean()), 5),
            greedy_flip_fraction=round(float((greedy != ref_greedy).float().mean()), 4), status="ok"))
        print(rows[-1], flush=True)
    for row in rows:
        errors = {"a_fp4": {"lora_A": rel_err["lora_A"]}, "b_fp4": {"lora_B": rel_err["lora_B"]},
                  "a_fp4x2": {"lora_A": rel_err["lora_A x2"]},
                  "ab_fp4": {k: rel_err[k] for k in ("lora_A", "lora_B")}}  # fmt: skip
        row["weight_rel_rms_error"] = errors.get(row["variant"])
        row.update(dtype=a.dtype, adapter=os.path.abspath(a.adapter), prompts=a.prompts, samples=a.samples,
                   new_tokens=a.new_tokens, prompt_len=prompt_len, commit=git_commit())  # fmt: skip
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, "lora_fp4_precision-cpu.json")
    if os.path.exists(path):  # one file for both dtypes: this run's rows replace those of its dtype
        with open(path) as f:
            rows = [r for r in json.load(f)["rows"] if r.get("dtype", "bfloat16") != a.dtype] + rows
    path = write_result("lora_fp4_precision", rows, a.out_dir, "python benchmarks/lora_fp4_precision.py --adapter "
                        "<the demo's output> --dtype {bfloat16,float32}")  # fmt: skip
    print("wrote", path)
    return path


if __name__ == "__main__":
    main()
