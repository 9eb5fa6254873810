"""Rollout decode speed in vLLM: merged BF16 vs NVFP4 + vLLM's LoRA vs NVFP4 alone, at Qwen2.5 shapes (issue #15).

    python benchmarks/rollout.py --sizes 7b --out-dir benchmarks/results        # -> rollout-<gpu>.json
    python benchmarks/rollout.py --sizes 7b 14b --batches 1 8 16 64 128 --arms bf16_merged nvfp4
    python benchmarks/rollout.py --sizes 32b --deadline 580 --out-dir $OUT   # inside a 600 s device call

Arms, each one vLLM engine in its own process (random weights; ``ignore_eos`` so every sequence decodes
``--gen-len`` tokens in every arm):

* ``bf16_merged``: the BF16 checkpoint, no LoRA. This is what TRL's rollout costs: it merges the LoRA into the
  BF16 weights before every sync, so generation runs dense BF16 matmuls. A 32B BF16 checkpoint (65 GB) does not
  fit the GPU machine's disk, so at 32B vLLM makes up random weights itself (``load_format="dummy"``, from a
  config-only directory) and gets ``DUMMY_BF16_GPU_MEMORY_UTILIZATION`` of the GPU for the KV cache beside them;
* ``nvfp4_vllm_lora``: the NVFP4A16 checkpoint (vLLM's Marlin FP4 kernel on Hopper) with a rank-``--lora-r``
  adapter on every linear, served by vLLM's multi-LoRA path as QeRL serves it today (``LoRARequest``);
* ``nvfp4_qerl_lora``: the same checkpoint and adapter on QeRL's single-LoRA vLLM method (``qerl_nvfp4_lora``,
  ``QeRLGRPOConfig(vllm_lora_backend="qerl")``): the LoRA built into each linear, pushed in place;
* ``nvfp4_qerl_lora_expand``: ``nvfp4_qerl_lora`` with the LoRA's B inside Humming's GEMM
  (``vllm_lora_expand_in_gemm``; ``@humming`` only);
* ``nvfp4``: the NVFP4A16 checkpoint without LoRA: the ceiling for any FP4 + LoRA path.

``--sizes 30b-a3b`` (Qwen3-30B-A3B, issue #54) runs ``bf16_merged`` (vLLM's dummy loader: 61 GB of BF16) and
``nvfp4[@kernel]`` (the random NVFP4A16 MoE checkpoint, experts per expert as llm-compressor writes them); its rows
name the experts' kernel (``expert_kernels``). The LoRA arms are refused there: their adapters cover dense linears.

Each FP4 arm runs on an FP4 kernel, named after an ``@``: ``nvfp4@humming``, ``nvfp4_qerl_lora@humming``
(``--arms``; default ``marlin``, vLLM's NVFP4A16 kernel on Hopper). ``humming`` is Humming (``humming-kernels``):
``quantization="humming"`` for the ``nvfp4`` and ``nvfp4_vllm_lora`` arms, and QeRL's method with
``fp4_kernel="humming"`` for ``nvfp4_qerl_lora``. Each row names its ``kernel`` and the kernels its engine's linears
really ran (``fp4_kernels``: layer counts per kernel).

A row per (size, arm, batch): ``tokens_per_s`` (generated tokens over the wall time of a ``generate`` call of
``batch`` prompts of ``--prompt-len`` tokens, the median of ``--repeats`` calls, with ``tokens_per_s_min`` /
``_max``; rows before the option timed one call; the prefill is included and small next to the decode),
``ms_per_token_step`` and ``vs_bf16_merged``; ``weights`` (where they came from), ``kv_tokens`` (the engine's KV
cache capacity) and ``kv_limited`` (the batch's tokens exceed it, so vLLM ran fewer sequences at once). An engine
that fails or runs out of memory gives rows with its status. Every row keeps its ``commit`` and ``run`` (one
invocation: one machine, a size's arms back to back); ratios are computed only within a run. ``--deadline`` makes a
call that runs out of time end as rows too (an engine cut short is a ``timeout`` row with its log's tail, one that
could not start a ``not_run`` row), instead of being killed by the device with nothing written.

    python benchmarks/rollout.py --merge benchmarks/results/rollout-h100.json /tmp/out/rollout-h100.json \
        --out-dir benchmarks/results        # later rows replace earlier ones of the same size, arm and batch
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

ARMS = ("bf16_merged", "nvfp4_vllm_lora", "nvfp4_qerl_lora", "nvfp4_qerl_lora_expand", "nvfp4")
LORA_ARMS = ("nvfp4_vllm_lora", "nvfp4_qerl_lora", "nvfp4_qerl_lora_expand")
QERL_LORA_ARMS = ("nvfp4_qerl_lora", "nvfp4_qerl_lora_expand")  # QeRL's single-LoRA method, the LoRA pushed in place
FP4_KERNELS = ("marlin", "humming")
#: ``--arms`` default: issue #38's set, every FP4 arm with the LoRA on Humming
DEFAULT_ARMS = ("bf16_merged", "nvfp4@marlin", "nvfp4@humming", "nvfp4_vllm_lora@humming", "nvfp4_qerl_lora@humming")
LORA_SCALING = 2.0  # lora_alpha = 2r
BATCHES = (1, 8, 16, 64, 128)
#: vLLM's share of the GPU per engine: weights plus the KV cache of 128 sequences of 768 tokens
GPU_MEMORY_UTILIZATION = 0.85
#: for the BF16 arm served from vLLM's dummy loader (32B: 65 GB of weights, which 0.85 of an 80 GB GPU barely holds)
DUMMY_BF16_GPU_MEMORY_UTILIZATION = 0.93
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: with ``--deadline``: seconds kept back to write the rows before the device call's own limit kills the process
DEADLINE_MARGIN_S = 15.0
#: with ``--deadline``: an engine is not started with less time than this left (none has started in under a minute)
MIN_ENGINE_S = 60.0


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    size: str
    arm: str
    batches: tuple[int, ...]
    prompt_len: int = 256
    gen_len: int = 512
    lora_r: int = 32
    kernel: str | None = None  # FP4 arms: "marlin" or "humming"; None for bf16_merged
    profile_batches: tuple[int, ...] = ()  # after the timed batches: one decode step of each, profiled
    repeats: int = 5  # timed generate calls per batch: the row is the median call, with the min-max of tokens/s
    search_rows: tuple[int, ...] = ()  # Humming arms, last: Humming's configs timed at these rows (humming_search)


def parse_arm(text: str) -> tuple[str, str | None]:
    """``"nvfp4_qerl_lora@humming"`` -> ``("nvfp4_qerl_lora", "humming")``; an FP4 arm without ``@`` is on Marlin."""
    arm, _, kernel = text.partition("@")
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}: one of {ARMS}, an FP4 one optionally @{'|@'.join(FP4_KERNELS)}")
    if arm == "bf16_merged":
        if kernel:
            raise ValueError("bf16_merged has no FP4 kernel")
        return arm, None
    kernel = kernel or "marlin"
    if kernel not in FP4_KERNELS:
        raise ValueError(f"unknown FP4 kernel {kernel!r} in {text!r}: one of {FP4_KERNELS}")
    if arm == "nvfp4_qerl_lora_expand" and kernel != "humming":
        raise ValueError(f"{text!r}: the expand runs inside Humming's GEMM; name it nvfp4_qerl_lora_expand@humming")
    return arm, kernel


def row_kernel(row: dict) -> str | None:
    """A row's FP4 kernel; rows from before the kernel was recorded ran on Marlin."""
    return None if row["arm"] == "bf16_merged" else row.get("kernel") or "marlin"


def lora_shapes(config) -> dict[str, tuple[int, int]]:
    """``{module: (in_features, out_features)}`` of a Qwen2/Llama decoder layer's linears."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip


def lora_targets(config) -> tuple[str, ...]:
    """The LoRA arms' targets: every linear of a dense model; the attention of a mixture-of-experts one, as the
    trainer puts it there (as ``QeRLGRPOTrainer`` does on a MoE: its MLP is the experts)."""
    from qerl_trl.quantizer.moe import MOE_LORA_TARGETS, moe_expert_count

    return MOE_LORA_TARGETS if moe_expert_count(config) else LORA_TARGETS


def random_lora(config, r: int, seed: int = 0) -> dict:
    """``{module name: (A [r, in], B [out, r])}`` on every :func:`lora_targets` linear of every layer, random A and B
    (B non-zero, so the LoRA changes the outputs), named as in vLLM's and transformers' module trees
    (``model.layers.0.mlp.up_proj``)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    targets = lora_targets(config)
    shapes = {k: v for k, v in lora_shapes(config).items() if k in targets}
    for layer in range(config.num_hidden_layers):
        for module, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            a = torch.randn(r, fan_in, generator=gen) / fan_in**0.5
            out[f"model.layers.{layer}.{part}.{module}"] = (a, torch.randn(fan_out, r, generator=gen) * 1e-3)
    return out


def write_random_adapter(path: str, config, r: int, seed: int = 0) -> str:
    """:func:`random_lora` as a PEFT adapter (``lora_alpha = 2r``), written in the layout QeRL hands to vLLM's LoRA
    path (``qerl_trl.trainer.vllm_serving.write_adapter_dir``)."""
    from peft import LoraConfig

    from qerl_trl.trainer.vllm_serving import write_adapter_dir

    tensors = {}
    for name, (a, b) in random_lora(config, r, seed).items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(lora_targets(config)), lora_dropout=0.0, bias="none",
                     task_type="CAUSAL_LM")  # fmt: skip
    write_adapter_dir(path, tensors, cfg)
    return path


def qerl_lora_engine_kwargs(checkpoint: str, r: int, kernel: str = "marlin", expand_in_gemm: bool = False) -> dict:
    """``LLM(...)`` arguments of the ``nvfp4_qerl_lora`` arm: QeRL's method with a rank-``r`` LoRA on every
    :func:`lora_targets` linear, its base GEMM on ``kernel`` (``expand_in_gemm``: the ``_expand`` arm)."""
    from qerl_trl.vllm_plugin import QUANT_NAME, lora_quantization_overrides, register

    from qerl_trl.trainer.vllm_serving import compile_cache_marker

    register(strict=True)
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    overrides = lora_quantization_overrides(config, r, lora_targets(config), kernel, expand_in_gemm=expand_in_gemm)
    # vLLM's compile cache ignores hf_overrides: the marker keeps another rank from loading these kernels
    return {"quantization": QUANT_NAME, "hf_overrides": overrides,
            "additional_config": compile_cache_marker([], overrides)}


def engine_source(spec: EngineSpec, work: str) -> tuple[str, dict, str]:
    """``(model directory, extra LLM(...) arguments, where the weights come from)`` for an arm's engine. Checkpoints
    come from ``e2e_step.prepare_checkpoints``; a BF16 model too large for the disk gets a config-only directory
    and vLLM's dummy loader."""
    from benchmarks import e2e_step as e2e
    from benchmarks import random_models as rm

    paths = e2e.checkpoint_paths(work, spec.size)
    if spec.arm != "bf16_merged":
        return paths["nvfp4"], {}, "random NVFP4A16 checkpoint"
    if spec.size in e2e.BF16_MAX_SIZE:
        return paths["bf16"], {}, "random BF16 checkpoint"
    config_dir = rm.write_config_dir(os.path.join(work, f"{spec.size}-bf16-config"), e2e.SIZES[spec.size])
    return (config_dir, dict(load_format="dummy", gpu_memory_utilization=DUMMY_BF16_GPU_MEMORY_UTILIZATION),
            "vLLM dummy weights (load_format='dummy'; no checkpoint fits the disk)")  # fmt: skip


def expert_kernels_of(model) -> dict[str, int]:
    """``{expert method (its experts class): layers}`` of a vLLM model's fused-MoE layers, {} for a dense model: the
    NVFP4 experts' kernel as vLLM 0.24 chose it (``CompressedTensorsW4A4Nvfp4MoEMethod`` and its ``experts_cls``,
    e.g. ``MarlinExperts``, or ``HummingMoEMethod``); ``fp4_kernels_of`` names the linear layers'. Under vLLM's
    LoRA the layer is wrapped (``FusedMoEWithLoRA``, whose ``quant_method`` is its base layer's) and the method too
    (``FusedMoEModularMethod`` around the original, named ``FusedMoEModularMethod(<original>)``): a method is
    counted once."""
    from collections import Counter

    def name(method) -> str:
        inner = getattr(method, "old_quant_method", None)
        if inner is not None:
            return f"{type(method).__name__}({name(inner)})"
        experts = getattr(method, "experts_cls", None)
        return type(method).__name__ + (f" ({experts.__name__})" if experts is not None else "")

    out: Counter = Counter()
    seen: set[int] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(module, "moe_config") or id(method) in seen:
            continue
        seen.add(id(method))
        out[name(method)] += 1
    return dict(out)


def kv_cache_tokens(llm) -> int | None:
    """The in-process engine's KV cache capacity in tokens (vLLM 0.24: ``cache_config.num_gpu_blocks`` x
    ``block_size``, set after its memory profiling), or None where it cannot be read."""
    cache = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
    blocks, block = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    return int(blocks) * int(block) if blocks and block else None


# ------------------------------------------------------------------------------------------ one engine (child)
def run_engine(spec: EngineSpec, work: str) -> list[dict]:
    """Build the arm's engine once, then time one ``generate`` per batch size; a row per batch."""
    from benchmarks import e2e_step as e2e
    from benchmarks import random_models as rm

    base = dict(size=spec.size, arm=spec.arm, kernel=spec.kernel, prompt_len=spec.prompt_len, gen_len=spec.gen_len,
                lora_r=spec.lora_r if spec.arm in LORA_ARMS else 0)  # fmt: skip
    try:
        import torch
        from transformers import AutoConfig
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        model, source_kwargs, weights = engine_source(spec, work)
        base["weights"] = weights
        lora = spec.arm == "nvfp4_vllm_lora"
        t0 = time.perf_counter()
        lora_kwargs = dict(enable_lora=True, max_lora_rank=spec.lora_r, max_loras=1) if lora else {}
        if spec.arm in QERL_LORA_ARMS:
            lora_kwargs = qerl_lora_engine_kwargs(model, spec.lora_r, spec.kernel,
                                                  expand_in_gemm=spec.arm == "nvfp4_qerl_lora_expand")  # fmt: skip
        elif spec.kernel == "humming":
            lora_kwargs["quantization"] = "humming"
        source_kwargs.setdefault("gpu_memory_utilization", GPU_MEMORY_UTILIZATION)
        llm = LLM(model=model, max_model_len=spec.prompt_len + spec.gen_len + 16, max_num_seqs=max(spec.batches),
                  seed=0, **source_kwargs, **lora_kwargs)  # fmt: skip
        init_s = time.perf_counter() - t0
        kv_tokens = kv_cache_tokens(llm)
        if spec.kernel:
            from collections import Counter

            from qerl_trl.vllm_plugin.single_lora import fp4_kernels_of

            base["fp4_kernels"] = dict(Counter(llm.apply_model(fp4_kernels_of)[0].values()))
            if spec.kernel == "humming":  # the row intervals Humming compiled kernels for (issue #55 item 4)
                from qerl_trl.vllm_plugin.humming_ahead import humming_tables_of

                try:
                    base["humming_tables"] = llm.apply_model(humming_tables_of)[0]
                except Exception as e:  # a diagnostic: never the row's failure
                    base["humming_tables"] = f"failed: {e!r}"
        if spec.size in e2e.MOE_SIZES:
            base["expert_kernels"] = llm.apply_model(expert_kernels_of)[0]
        request = None
        if lora:
            from vllm.lora.request import LoRARequest

            adapter = write_random_adapter(os.path.join(work, f"adapter-{spec.size}-r{spec.lora_r}"),
                                           AutoConfig.from_pretrained(model), spec.lora_r)  # fmt: skip
            request = LoRARequest(lora_name="bench", lora_int_id=1, lora_path=adapter)
        if spec.arm in QERL_LORA_ARMS:
            from qerl_trl.vllm_plugin.single_lora import push_lora_in_place

            pairs = random_lora(AutoConfig.from_pretrained(model), spec.lora_r)
            adapters = {k: (a.to(torch.bfloat16), b.to(torch.bfloat16)) for k, (a, b) in pairs.items()}
            filled = sum(llm.apply_model(lambda m: push_lora_in_place(m, adapters, LORA_SCALING)))
            if filled == 0:
                raise RuntimeError("no single-LoRA layer in the engine")
        vocab = AutoConfig.from_pretrained(model).vocab_size
        gen = torch.Generator().manual_seed(0)
        eos = rm.eos_token_id(vocab)

        def prompts(n: int):
            ids = torch.randint(0, vocab, (n, spec.prompt_len), generator=gen)
            ids[ids == eos] = eos - 1
            return [TokensPrompt(prompt_token_ids=row.tolist()) for row in ids]

        params = SamplingParams(max_tokens=spec.gen_len, min_tokens=spec.gen_len, ignore_eos=True, temperature=1.0)
        llm.generate(prompts(2), SamplingParams(max_tokens=8, ignore_eos=True), lora_request=request)  # warm-up
        rows = []
        for batch in spec.batches:
            batch_prompts = prompts(batch)
            tokens, walls = timed_generates(
                lambda: llm.generate(batch_prompts, params, lora_request=request, use_tqdm=False),
                spec.repeats, torch.cuda.synchronize)
            timing = repeat_summary(tokens, walls)
            bad = [t for t in tokens if t != batch * spec.gen_len]
            status = "ok" if not bad else f"check_failed: {bad[0]} tokens generated, want {batch * spec.gen_len}"
            rows.append(dict(base, batch=batch, status=status, **timing, init_s=round(init_s, 1),
                             ms_per_token_step=round(1000 * timing["wall_s"] / spec.gen_len, 3),
                             gpu_memory_utilization=source_kwargs["gpu_memory_utilization"], kv_tokens=kv_tokens,
                             kv_limited=bool(kv_tokens) and batch * (spec.prompt_len + spec.gen_len) > kv_tokens))
        for batch in spec.profile_batches:  # after the timed batches: where one decode step's time goes
            from benchmarks.decode_profile import profile_decode_step

            profile = profile_decode_step(llm, prompts(batch), request, AutoConfig.from_pretrained(model))
            for r in rows:
                if r["batch"] == batch:
                    r["decode_profile"] = profile
        if spec.search_rows and spec.kernel == "humming":  # last: it compiles many kernels beside the engine's
            from benchmarks.humming_search import search_model

            search = llm.apply_model(lambda m: search_model(m, spec.search_rows))[0]
            for r in rows:
                r["humming_search"] = search
        return rows
    except BaseException as e:  # noqa: BLE001 - a failed engine is rows with its status
        return [dict(base, batch=b, status=e2e._classify(e), traceback=traceback.format_exc()[-2500:])
                for b in spec.batches]  # fmt: skip


def timed_generates(generate: Callable[[], list], repeats: int,
                    sync: Callable[[], None]) -> tuple[list[int], list[float]]:  # fmt: skip
    """``repeats`` calls of ``generate`` (one batch), each between device syncs: the tokens each call generated and
    its wall seconds."""
    tokens, walls = [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        outs = generate()
        sync()
        walls.append(time.perf_counter() - t0)
        tokens.append(sum(len(o.outputs[0].token_ids) for o in outs))
    return tokens, walls


def repeat_summary(tokens: list[int], walls: list[float]) -> dict:
    """A row's timing over its repeats: the median call (``wall_s``, ``tokens_per_s``) with the fastest and slowest
    calls' tokens/s, and every call's wall time."""
    rates = [t / w for t, w in zip(tokens, walls)]
    mid = sorted(range(len(walls)), key=lambda i: walls[i])[len(walls) // 2]
    return {"repeats": len(walls), "wall_s": round(walls[mid], 3), "tokens": tokens[mid],
            "tokens_per_s": round(rates[mid], 1), "tokens_per_s_min": round(min(rates), 1),
            "tokens_per_s_max": round(max(rates), 1), "wall_s_per_call": [round(w, 3) for w in walls]}  # fmt: skip


def _same(r: dict) -> tuple:
    """Rows that may be compared: same size, batch and run (rows of no run compare with nothing)."""
    return r["size"], r["batch"], r.get("run") or id(r)


def add_speedups(rows: list[dict]) -> None:
    """``vs_bf16_merged``: tokens/s over the merged-BF16 arm's at the same size and batch, in the same run; and
    ``lora_overhead_vs_nvfp4`` against the no-LoRA arm on the same FP4 kernel likewise."""
    ref = {_same(r): r["tokens_per_s"] for r in rows if r["arm"] == "bf16_merged" and r.get("status") == "ok"}
    for r in rows:
        base = ref.get(_same(r))
        r["vs_bf16_merged"] = round(r["tokens_per_s"] / base, 3) if base and r.get("status") == "ok" else None
    ceiling = {(*_same(r), row_kernel(r)): r["tokens_per_s"] for r in rows
               if r["arm"] == "nvfp4" and r.get("status") == "ok"}  # fmt: skip
    for r in rows:
        top = ceiling.get((*_same(r), row_kernel(r)))
        if r["arm"] not in ("nvfp4", "bf16_merged"):
            r["lora_overhead_vs_nvfp4"] = round(top / r["tokens_per_s"] - 1, 3) if top and r["status"] == "ok" else None


def merge(files: list[str], out_dir: str) -> str:
    """Result files (``rollout-<gpu>.json``) -> one. A later file's row replaces earlier rows of the same (size, arm,
    batch) from another commit; rows of one commit from several runs are all kept (a size's arms split over two
    calls, each with its own merged-BF16 baseline). Rows keep their ``commit`` and ``run``; ratios are recomputed
    within runs. The envelope is the last file's, with every commit named."""
    from benchmarks._common import keep_runs, result_envelope

    rows: list[dict] = []
    seen: dict[str, None] = {}
    env: dict = {}
    for path in files:
        with open(path) as f:
            env = json.load(f)
        for r in env["rows"]:
            r.setdefault("commit", env.get("commit"))
            seen.setdefault(str(r["commit"]), None)
        rows = keep_runs(rows, env["rows"], lambda r: (r["size"], r["arm"], row_kernel(r), r["batch"]),
                         is_baseline=lambda r: r["arm"] == "bf16_merged")  # fmt: skip
    add_speedups(rows)
    kept = {str(r["commit"]) for r in rows if r.get("commit")}
    commits = [c for c in seen if c in kept]  # in the order the files name them
    out = result_envelope("rollout", rows, "merged by benchmarks/rollout.py --merge from: " + "; ".join(
        json.load(open(p))["command"] for p in files))
    out.update(gpu=env.get("gpu", out["gpu"]), versions=env.get("versions", out["versions"]), commit=", ".join(commits))
    tag = os.path.basename(files[-1]).removeprefix("rollout-").removesuffix(".json")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"rollout-{tag}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return path


# ------------------------------------------------------------------------------------------ driver
def engine_timeout(timeout: float, deadline: float | None, elapsed: float) -> float | None:
    """Seconds the next engine may run: ``--timeout``, cut to what ``--deadline`` leaves after ``elapsed`` seconds
    less ``DEADLINE_MARGIN_S``; None when that is under ``MIN_ENGINE_S``, so the arm is recorded as not run.

    The device machine kills a call at its limit without warning: an engine still running then leaves no row. With
    a deadline a little under that limit, every arm ends as rows (measured, ``timeout`` or ``not_run``)."""
    if deadline is None:
        return timeout
    left = deadline - elapsed - DEADLINE_MARGIN_S
    return min(timeout, left) if left >= MIN_ENGINE_S else None


def run_arm(spec: EngineSpec, work: str, timeout: float) -> list[dict]:
    """One engine in its own process (``--child``): its rows, or rows with the failure's status. The child's output
    goes to ``<work>/rollout-<size>-<arm>[-<kernel>].log``; a failed or timed-out engine's rows keep its tail."""
    from benchmarks._child import run_child

    out = os.path.join(work, "rollout-rows.json")
    if os.path.exists(out):
        os.remove(out)
    log_path = os.path.join(work, f"rollout-{spec.size}-{spec.arm}{'-' + spec.kernel if spec.kernel else ''}.log")
    cmd = [sys.executable, __file__, "--child", json.dumps(dataclasses.asdict(spec)), "--work", work,
           "--rows-out", out]  # fmt: skip
    res = run_child(cmd, timeout, log_path=log_path)
    if not res.timed_out and os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    return [dict(size=spec.size, arm=spec.arm, kernel=spec.kernel, batch=b, status=res.status,
                 log_tail=res.log[-5000:]) for b in spec.batches]  # fmt: skip


def main(argv: list[str] | None = None) -> str | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="*", default=["7b"], help="of benchmarks/e2e_step.py's SIZES")
    ap.add_argument("--arms", nargs="*", default=list(DEFAULT_ARMS),
                    help=f"of {ARMS}, an FP4 arm optionally @marlin (the default) or @humming")
    ap.add_argument("--batches", nargs="*", type=int, default=list(BATCHES))
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=512)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed generate calls per batch; a row is the median call, with tokens/s min-max")
    ap.add_argument("--profile-batches", nargs="*", type=int, default=[],
                    help="also profile one decode step at each of these batches (of --batches) per engine: "
                    "benchmarks/decode_profile.py")
    ap.add_argument("--humming-search-rows", nargs="*", type=int, default=[],
                    help="on Humming arms, after the timed batches: time Humming's heuristic config against a sample "
                    "of its legal ones at these decode rows, on the engine's own layers (benchmarks/humming_search.py)")
    ap.add_argument("--work", default="/tmp/qerl-e2e", help="checkpoints (shared with e2e_step.py)")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per engine")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from start by which every engine must have ended (set it a little under the "
                    "device call's limit): an engine gets at most what is left, and one that cannot start in time is "
                    "recorded as not run, so a cut-off call still leaves a row per arm")
    ap.add_argument("--merge", nargs="*", help="result files to merge into <out-dir>/rollout-<gpu>.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rows-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not set(a.profile_batches) <= set(a.batches):
        ap.error(f"--profile-batches {a.profile_batches} must be among --batches {a.batches}")
    if a.merge:
        path = merge(a.merge, a.out_dir)
        print(f"wrote {path}")
        return path
    if a.child:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        fields = json.loads(a.child)
        spec = EngineSpec(**{**fields, "batches": tuple(fields["batches"]),
                             "profile_batches": tuple(fields.get("profile_batches", ())),
                             "search_rows": tuple(fields.get("search_rows", ()))})
        with open(a.rows_out, "w") as f:
            json.dump(run_engine(spec, a.work), f, default=str)
        return None
    from benchmarks import e2e_step as e2e
    from benchmarks._common import git_commit, gpu_uuid, new_run_id, write_result

    unknown = [s for s in a.sizes if s not in e2e.SIZES]
    if unknown:
        ap.error(f"unknown --sizes {unknown}: one of {list(e2e.SIZES)}")
    whole_humming = [text for text in a.arms if text.endswith("@humming") and not text.startswith("nvfp4_qerl_lora")]
    if whole_humming and set(a.sizes) & set(e2e.MOE_SIZES):
        from qerl_trl.vllm_plugin.fp4_kernel import HUMMING_MOE_PROBLEM

        ap.error(f"{whole_humming} on a mixture-of-experts size: these arms serve the whole model with "
                 f"quantization='humming', and {HUMMING_MOE_PROBLEM}; run them @marlin, or nvfp4_qerl_lora@humming "
                 "(Humming for the attention, Marlin MoE for the experts)")
    start = time.monotonic()
    run, commit, uuid = new_run_id(), git_commit(), gpu_uuid()
    rows: list[dict] = []
    path = None
    arms = [parse_arm(text) for text in a.arms]  # bad names fail before any checkpoint is written
    for size in a.sizes:
        need_bf16 = "bf16_merged" in a.arms and size in e2e.BF16_MAX_SIZE
        e2e.prepare_checkpoints(a.work, size, need_bf16=need_bf16)
        for arm, kernel in arms:
            spec = EngineSpec(size, arm, tuple(a.batches), a.prompt_len, a.gen_len, a.lora_r, kernel,
                              tuple(a.profile_batches), a.repeats, tuple(a.humming_search_rows))
            elapsed = time.monotonic() - start
            limit = engine_timeout(a.timeout, a.deadline, elapsed)
            if limit is None:
                why = f"not_run: {a.deadline - elapsed:.0f} s were left of --deadline {a.deadline:.0f} s"
                got = [dict(size=size, arm=arm, kernel=kernel, batch=b, status=why) for b in a.batches]
            else:
                got = run_arm(spec, a.work, limit)
            for r in got:
                r.update(commit=commit, run=run, gpu_uuid=uuid)
            rows += got
            for r in got:
                print(json.dumps({k: r.get(k) for k in ("size", "arm", "kernel", "batch", "tokens_per_s", "status",
                                                        "fp4_kernels")}), flush=True)  # fmt: skip
            # rewritten after every engine: a run cut off by a time limit keeps the arms it finished
            add_speedups(rows)
            path = write_result("rollout", rows, a.out_dir)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
