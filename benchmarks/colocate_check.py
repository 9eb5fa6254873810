"""Colocate check: QeRLGRPOTrainer + vLLM (colocate) on SmolLM2-135M-Instruct quantized to NVFP4 by qerl_trl.

A short GRPO run (use_vllm=True, vllm_mode="colocate") that checks, on the GPU machine:

1. after a LoRA sync, vLLM's log-probs of a fixed completion match the trainer's (HF model: NVFP4Linear + LoRA)
   within a stated tolerance, and differ from the base model's (the adapter really is served; the LoRA B
   matrices are perturbed first so the adapter is far from zero);
2. AQN noise is present in vLLM's norm weights at the scheduled σ (realized std within 10%) and absent at stage 0
   (norm weights kept float32 inside vLLM, see qerl_trl/trainer/vllm_serving/fp32_norms.py);
3. the engine's quantized linears run the FP4 kernel the trainer chose (``vllm_fp4_kernel="auto"``: Humming on a
   Hopper GPU where its shapes fit, Marlin elsewhere; SmolLM2's 576-wide layers keep most linears on Marlin);
4. TRL's importance-sampling ratio stays near 1;
plus step times, LoRA sync seconds, rollout tokens/s and peak GPU memory.

Run (GPU machine): VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/colocate_check.py --out <json>
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

DEFAULT_GGUF = "/tmp/gpu-extra/SmolLM2-135M-Instruct.Q4_1.gguf"
LOGPROB_TOL = 0.05  # mean |Δ log p| per completion token, vLLM (Marlin FP4 + LoRA) vs HF (NVFP4Linear + LoRA)
SERVED_MIN = 5 * LOGPROB_TOL  # the adapter must move vLLM's log-probs by more than 5x the match tolerance
AQN_REL_TOL = 0.10
IS_TOL = 0.15  # sequence-level ratios over up to 48 tokens are noisy per step; judged on the run mean
LPD_TOL = 0.10  # mean |log p_trainer - log p_vllm| per token


def prepare_bf16(gguf: str, out_dir: str) -> str:
    """SmolLM2-135M-Instruct from its GGUF (dequantized to bf16) saved as a plain HF checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    # the GGUF weights are dequantized on load; re-home them in a plain (serializable) bf16 model
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def digit_reward(completions, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]


def row(check, value, tolerance, ok, **extra):
    return {"check": check, "value": value, "tolerance": tolerance, "ok": ok, **extra}


def record_aqn_in_vllm(trainer) -> tuple[list[dict], Any]:
    """Record, after each round's sync, the AQN noise as vLLM's engine holds it: ``(rounds, stop)``. Each round:
    step, σ and stage of the schedule, the realized std and max |noise| of the norm weights in vLLM, and their
    dtypes there. ``stop()`` restores the trainer's own sync."""
    gen = trainer.vllm_generation
    clean = {k: v.detach().float().cpu() for k, v in trainer.aqn.clean_weights(trainer.model).items()}
    names = set(clean)
    rounds: list[dict] = []
    original_sync = gen.sync_weights

    def read_norms(m):
        return {n: (p.detach().float().cpu(), str(p.dtype)) for n, p in m.named_parameters() if n in names}

    def sync_and_record():
        original_sync()
        vals = gen.llm.apply_model(read_norms)[0]
        diff = torch.cat([(vals[n][0] - clean[n]).flatten() for n in sorted(names)])
        m = trainer.aqn.metrics(trainer.state)
        rounds.append({"step": trainer.state.global_step, "sigma": m["aqn/sigma"], "stage": int(m["aqn/stage"]),
                       "realized_std": float(diff.std()), "max_abs": float(diff.abs().max()),
                       "vllm_norm_dtypes": sorted({vals[n][1] for n in names}), "sync_s": gen.last_sync_seconds,
                       "vllm_norms_not_fp32": sorted(n for n in names if vals[n][1] != "torch.float32")[:6]})

    def stop():
        gen.sync_weights = original_sync

    gen.sync_weights = sync_and_record
    return rounds, stop


def lora_logprob_check(trainer, perturb: float = 5e-2, n_tokens: int = 32, seed: int = 1) -> dict:
    """vLLM's log-probs of a fixed completion against the trainer's (HF model: NVFP4Linear + LoRA), after a sync.

    The LoRA B matrices are perturbed first (``randn * perturb``) so the adapter is far from zero, the clean norms
    and the adapter are synced, a greedy completion is generated by vLLM, and both engines score it with and
    without the adapter. Returns mean |Δ log p| per completion token with the adapter (``match``) and without
    (``base_match``), how far the adapter moves vLLM's log-probs (``served``), and the token-level IS ratio."""
    from vllm import SamplingParams

    gen = trainer.vllm_generation
    llm = gen.llm  # LoRAServingLLM proxy
    model = trainer.model
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_((torch.randn(p.shape, generator=g) * perturb).to(p.device, p.dtype))
    gen.pending_norms = trainer.aqn.clean_weights(model) if trainer.aqn is not None else None
    gen.sync_weights()  # wakes the weights if TRL's last generate() put the engine to sleep
    if gen.enable_sleep_mode:
        # Only TRL's generate() wakes the KV cache (and puts it back to sleep after). This check calls the engine
        # directly, and a generate() on a sleeping KV cache never returns (it hung the 1.5B test at 408025e).
        llm.wake_up(tags=["kv_cache"])
    tok = trainer.processing_class
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": "Write one sentence about the sea."}],
                                       add_generation_prompt=True, tokenize=False)
    else:
        text = "Write one sentence about the sea."
    prompt_ids = list(tok(text, add_special_tokens=False)["input_ids"])
    out = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(max_tokens=n_tokens, temperature=0.0),
                       use_tqdm=False)
    completion = list(out[0].outputs[0].token_ids)
    full = prompt_ids + completion
    n_p = len(prompt_ids)

    def vllm_lp(lora_request):
        o = llm._llm.generate([{"prompt_token_ids": full}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              lora_request=lora_request, use_tqdm=False)
        plp = o[0].prompt_logprobs
        return torch.tensor([plp[i][full[i]].logprob for i in range(n_p, len(full))])

    def hf_lp(adapter: bool):
        model.eval()
        ids = torch.tensor([full], device=trainer.accelerator.device)
        ctx = model.disable_adapter() if not adapter else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            logits = model(input_ids=ids).logits.float()
        lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        return lp[n_p - 1 :].cpu()

    if llm.adapters:  # lora_backend="vllm": with and without the adapter request
        v_lora, v_base = vllm_lp(llm.lora_request), vllm_lp(None)
    else:  # lora_backend="qerl": the LoRA is in the layers; zero it for the base, then sync it back
        v_lora = vllm_lp(None)
        gen.clear_lora()
        v_base = vllm_lp(None)
        gen.sync_weights()
    h_lora, h_base = hf_lp(True), hf_lp(False)
    ratio = torch.exp(h_lora - v_lora)
    return {
        "match": float((v_lora - h_lora).abs().mean()),
        "max_abs": float((v_lora - h_lora).abs().max()),
        "base_match": float((v_base - h_base).abs().mean()),
        "served": float((v_lora - v_base).abs().mean()),
        "hf_lora_vs_base": float((h_lora - h_base).abs().mean()),
        "vllm_lora_vs_hf_base": float((v_lora - h_base).abs().mean()),
        "token_ratio_mean": float(ratio.mean()),
        "token_ratio_min": float(ratio.min()),
        "token_ratio_max": float(ratio.max()),
        "n_tokens": len(completion),
        "mean_logprob": float(h_lora.mean()),
    }


def run_check(
    gguf: str = DEFAULT_GGUF,
    work: str = "/tmp/qerl-colocate",
    max_steps: int = 6,
    sleep_mode: bool = False,
    max_completion_length: int = 48,
    lora_backend: str = "qerl",
    lora_sync_in_place: bool | None = None,
    fused_importance_sampling: bool | None = None,
) -> list[dict]:
    from datasets import Dataset

    from qerl_trl import QeRLGRPOConfig, QeRLGRPOTrainer
    from qerl_trl.aqn import AQNSchedule

    bf16_dir = prepare_bf16(gguf, os.path.join(work, "smollm2-bf16"))
    prompts = [
        [{"role": "user", "content": f"List the numbers from {i} to {i + 6}, separated by commas."}]
        for i in range(64)
    ]
    ds = Dataset.from_dict({"prompt": prompts})
    sigma_start, sigma_end, stages = 2e-3, 5e-4, 3
    args = QeRLGRPOConfig(
        output_dir=os.path.join(work, "out-sleep" if sleep_mode else "out"),
        report_to="none",
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="no",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=max_completion_length,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=512,
        vllm_enable_sleep_mode=sleep_mode,
        aqn_sigma_start=sigma_start,
        aqn_sigma_end=sigma_end,
        aqn_num_stages=stages,
        nvfp4_cache_dir=os.path.join(work, "cache"),
        vllm_lora_backend=lora_backend,
        **({} if lora_sync_in_place is None else {"vllm_lora_sync_in_place": lora_sync_in_place}),
        **({} if fused_importance_sampling is None else {"fused_importance_sampling": fused_importance_sampling}),
        seed=0,
    )
    t0 = time.perf_counter()
    trainer = QeRLGRPOTrainer(model=bf16_dir, reward_funcs=digit_reward, args=args, train_dataset=ds)
    init_s = time.perf_counter() - t0
    gen = trainer.vllm_generation
    llm = gen.llm  # LoRAServingLLM proxy

    # (2) AQN noise as vLLM holds it, after each round's sync
    aqn_rounds, stop_recording = record_aqn_in_vllm(trainer)
    t1 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t1
    stop_recording()
    hist = trainer.state.log_history
    steps = [h for h in hist if "loss" in h]
    rows = []

    # (2) rows
    sched = AQNSchedule(sigma_start, sigma_end, stages)
    for r in aqn_rounds:
        expected = sched.sigma(r["step"], max_steps)
        if r["stage"] == 0:
            rows.append(row("aqn_absent_stage0", r["max_abs"], 0.0, r["max_abs"] == 0.0, **r))
        else:
            rel = abs(r["realized_std"] - expected) / expected
            rows.append(
                row("aqn_sigma_in_vllm", r["realized_std"], f"within {AQN_REL_TOL:.0%} of sigma={expected:g}",
                    rel <= AQN_REL_TOL and r["sigma"] == expected, rel_err=rel, **r)
            )

    # (3) the FP4 kernel the trainer chose runs the engine's quantized linears
    from collections import Counter

    from qerl_trl.vllm_plugin.single_lora import fp4_kernels_of

    ks = {name: k.removesuffix("+expand") for name, k in llm.apply_model(fp4_kernels_of)[0].items()}  # on Humming
    kinds = dict(Counter(k.split(" (")[0] for k in ks.values()))
    want = gen.serving.fp4_kernel
    ok = bool(ks) and all(k == "humming" or k.startswith("marlin: ") for k in ks.values()) and (
        any(k == "humming" for k in ks.values()) if want == "humming" else all(k != "humming" for k in ks.values()))
    rows.append(row("fp4_kernel", kinds, f"every quantized linear on Humming or Marlin, {want} as chosen", ok,
                    n_quantized_linears=len(ks), chosen=want))

    # (4) IS ratio
    is_mean = [h["sampling/importance_sampling_ratio/mean"] for h in steps if "sampling/importance_sampling_ratio/mean" in h]
    is_min = [h["sampling/importance_sampling_ratio/min"] for h in steps if "sampling/importance_sampling_ratio/min" in h]
    is_max = [h["sampling/importance_sampling_ratio/max"] for h in steps if "sampling/importance_sampling_ratio/max" in h]
    lpd = [h["sampling/sampling_logp_difference/mean"] for h in steps if "sampling/sampling_logp_difference/mean" in h]
    overall = statistics.fmean(is_mean) if is_mean else float("nan")
    rows.append(
        row("is_ratio_mean", overall,
            f"TRL default sequence_mask IS ratio: mean over steps within {IS_TOL} of 1, and token-level "
            f"sampling_logp_difference/mean <= {LPD_TOL} every step",
            bool(is_mean) and abs(overall - 1) <= IS_TOL and all(x <= LPD_TOL for x in lpd),
            per_step_mean=is_mean, per_step_min=is_min, per_step_max=is_max, sampling_logp_difference_mean=lpd)
    )

    # (1) LoRA served: perturb B so the adapter is far from zero, sync clean norms, compare log-probs
    lp = lora_logprob_check(trainer)
    rows.append(
        row("lora_logprob_match_vllm_vs_trainer", lp["match"], LOGPROB_TOL, lp["match"] <= LOGPROB_TOL,
            max_abs=lp["max_abs"], n_tokens=lp["n_tokens"], base_match=lp["base_match"])
    )
    rows.append(
        row("token_is_ratio_fixed_completion", lp["token_ratio_mean"], f"within {IS_TOL} of 1",
            abs(lp["token_ratio_mean"] - 1) <= IS_TOL, min=lp["token_ratio_min"], max=lp["token_ratio_max"])
    )
    rows.append(
        row("lora_served_vllm_lora_vs_base", lp["served"], f">= {SERVED_MIN}", lp["served"] >= SERVED_MIN,
            hf_lora_vs_base=lp["hf_lora_vs_base"], vllm_lora_vs_hf_base=lp["vllm_lora_vs_hf_base"])
    )

    # timings and memory
    step_times = [h.get("step_time") for h in steps]
    rows.append(row("step_time_s", step_times, None, None, init_s=init_s, train_s=train_s))
    rows.append(row("lora_sync_s", [h.get("qerl/lora_sync_seconds") for h in steps], None, None))
    rows.append(row("rollout_tokens_per_s", [h.get("qerl/rollout_tokens_per_s") for h in steps], None, None))
    rows.append(
        row("peak_gpu_memory_gib", max((h.get("qerl/peak_gpu_memory_gib") or 0) for h in steps), None, None,
            torch_max_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
            note="torch allocator only; vLLM's KV cache pool (vllm_gpu_memory_utilization=0.3) is separate")
    )
    rows.append(row("losses_finite", [h["loss"] for h in steps], "finite",
                    all(math.isfinite(h["loss"]) for h in steps)))
    for r in rows:
        r["lora_backend"] = lora_backend
        r["lora_sync_in_place"] = args.vllm_lora_sync_in_place
        r["fused_importance_sampling"] = args.fused_importance_sampling  # None: where the rounds allow it
        r["fused_pass"] = trainer._fused_is
        if sleep_mode:
            r["check"] = "sleep1/" + r["check"]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--work", default="/tmp/qerl-colocate")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--sleep", action="store_true", help="also vllm_enable_sleep_mode=True (sleep level 1)")
    ap.add_argument("--lora_backend", default="qerl", choices=["qerl", "vllm"], help="QeRLGRPOConfig.vllm_lora_backend")
    ap.add_argument("--lora_sync_files", action="store_true",
                    help='QeRLGRPOConfig.vllm_lora_sync_in_place=False (lora_backend "vllm": every round\'s adapter '
                    "loaded from files, not refreshed in place on the GPU)")
    ap.add_argument("--fused_importance_sampling", action="store_const", const=True, default=None,
                    help="QeRLGRPOConfig.fused_importance_sampling=True (the IS ratio from the training forward; "
                    "default: the config's own default)")
    ap.add_argument("--no_fused_importance_sampling", dest="fused_importance_sampling", action="store_const",
                    const=False, help="fused_importance_sampling=False (TRL's separate forward for the IS ratio)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from benchmarks._common import gpu_tag, result_envelope

    rows = run_check(a.gguf, a.work, a.steps, sleep_mode=a.sleep, lora_backend=a.lora_backend,
                     lora_sync_in_place=False if a.lora_sync_files else None,
                     fused_importance_sampling=a.fused_importance_sampling)
    for r in rows:
        print(json.dumps(r, default=str))
    tag = gpu_tag() if a.lora_backend == "vllm" else f"{a.lora_backend}-{gpu_tag()}"
    out = a.out or os.path.join(os.path.dirname(__file__), "results", f"colocate_check-{tag}.json")
    env = result_envelope("colocate_check", rows, "VLLM_ENABLE_V1_MULTIPROCESSING=0 python " + " ".join(sys.argv))
    env["versions"]["compressed-tensors"] = __import__("importlib.metadata").metadata.version("compressed-tensors")
    with open(out, "w") as f:
        json.dump(env, f, indent=1, default=str)
    bad = [r["check"] for r in rows if r["ok"] is False]
    print("FAILED:" if bad else "ALL OK", bad)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
