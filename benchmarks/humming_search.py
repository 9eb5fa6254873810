"""Humming's kernel configs at decode rows, timed on the real layers of a vLLM engine (issue #55 item 3: "Humming's
configs for M <= 64 (its tuner, split-K)").

Why: Humming picks one config per row count from a heuristic (humming-kernels 0.1.19 ``tune/``); nothing times them.
In the 8 x 8 x 512 rollout profile (``e2e_step-h200.json``, run 20261128T015559Z-e3dd8a) its 64-row GEMMs moved 1.2-1.5
TB/s of the H200's 4.8, with a 64 x 128 tile for every 7B shape, and they were 1.58 s of the round's 3.22 s of GPU
time. This times, for each distinct Humming layer config of the engine and each decode row count, the heuristic's
config against a sample of Humming's own legal configs (``humming.testing.tuning.sample_test_tuning_configs``, what
Humming's kernel tests run), each checked against the heuristic's output. Where a config wins, the engine's table
(:mod:`qerl_trl.vllm_plugin.humming_ahead`) is where it would go.

Each time is a CUDA graph of one call per layer of that config, in model order (28 at 7B), so every call reads
weights that are not in L2, as a decode step does; ``benchmarks.lora_delta.graph_us`` replays it. Run it from
``rollout.py --humming-search-rows 16 32 64`` on a Humming arm: the rows then carry ``humming_search``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

#: decode row counts searched by default: an engine of 16 sequences (2 x 8), and of 64 (8 x 8)
SEARCH_ROWS = (16, 32, 64)
#: Humming configs sampled per layer config (each compiled once, on the machine's cores)
SAMPLE = 48
#: a candidate's output may differ from the heuristic's by this much of the output's largest magnitude (the split of
#: K and the order of the fp32 sums differ; a wrong kernel is off by far more)
MAX_REL_DIFF = 2e-2


def search_layer(compile_config: Callable[[dict], None], run: Callable[[dict, int], Any],
                 time_us: Callable[[dict, int], float], heuristic: Callable[[int], dict],
                 candidates: Sequence[dict], rows: Sequence[int], rel_diff: Callable[[Any, Any], float],
                 workers: int = 8) -> dict[str, Any]:  # fmt: skip
    """For one layer config: each candidate compiled (in parallel; a failure only drops it), then at each row count
    the heuristic's time and every compiled candidate's whose output matches the heuristic's, and the best.

    ``{"candidates": n, "compile_failed": [..errors..], "rows": {"16": {"heuristic_us", "heuristic_config",
    "best_us", "best_config", "speedup", "timed", "wrong"}}}``"""
    unique: dict[str, dict] = {}
    for config in candidates:
        unique.setdefault(json.dumps(config, sort_keys=True), config)

    def try_compile(config: dict) -> str | None:
        try:
            compile_config(config)
            return None
        except Exception as e:  # noqa: BLE001 - a config Humming cannot build is skipped, with why
            return f"{type(e).__name__}: {e}"[:300]

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        errors = list(pool.map(try_compile, unique.values()))
    compiled = [c for c, e in zip(unique.values(), errors, strict=True) if e is None]
    out: dict[str, Any] = {"candidates": len(unique), "compile_failed": [e for e in errors if e], "rows": {}}
    for m in rows:
        base = heuristic(m)
        reference = run(base, m)
        base_us = time_us(base, m)
        best, best_us, timed, wrong = base, base_us, 0, 0
        for config in compiled:
            if rel_diff(run(config, m), reference) > MAX_REL_DIFF:
                wrong += 1
                continue
            us = time_us(config, m)
            timed += 1
            if us < best_us:
                best, best_us = config, us
        out["rows"][str(m)] = {"heuristic_us": round(base_us, 2), "heuristic_config": base,
                               "best_us": round(best_us, 2), "best_config": best,
                               "speedup": round(base_us / best_us, 3), "timed": timed, "wrong": wrong}  # fmt: skip
    return out


def _max_rel_diff(out: Any, ref: Any) -> float:
    """Largest absolute difference over the reference's largest magnitude (inf for a non-finite output)."""
    import torch

    diff = (out.float() - ref.float()).abs().max()
    if not torch.isfinite(diff):
        return float("inf")
    return float(diff / ref.float().abs().max().clamp_min(1e-6))


def search_model(model: Any, rows: Sequence[int] = SEARCH_ROWS, sample: int = SAMPLE) -> dict[str, Any]:
    """``{"NxK": search_layer(...)}`` for each distinct Humming layer config of a vLLM model (run it with
    ``LLM.apply_model``): its real layers, Humming's heuristic config at each row count and ``sample`` of its legal
    configs."""
    import torch
    from humming.config import ComputeConfig, LayerConfig
    from humming.kernel.humming import HummingKernel
    from humming.testing.tuning import sample_test_tuning_configs

    from benchmarks.lora_delta import graph_us
    from qerl_trl.vllm_plugin.humming_ahead import HummingAhead, _config_at, _humming_table, humming_layers

    device = torch.cuda.current_device()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: dict[str, Any] = {}
    for layer_config, (compute, _, layers) in humming_layers(model).items():
        parsed = json.loads(layer_config)
        name = f"{parsed.get('shape_n')}x{parsed.get('shape_k')}"
        try:
            table = _humming_table(layer_config, compute, device)
            fields = {k: v for k, v in parsed.items() if k != "sublayer_name"}
            with torch.cuda.device(device):
                candidates = sample_test_tuning_configs(LayerConfig(**fields), ComputeConfig(**json.loads(compute)),
                                                        sample)  # fmt: skip
            inputs = {m: torch.randn(m, parsed["shape_k"], generator=gen, device="cuda", dtype=torch.bfloat16) * 0.1
                      for m in rows}  # fmt: skip

            def run(config: dict, m: int, layer: Any = layers[0]) -> torch.Tensor:
                return HummingAhead.apply(layer, inputs[m], compute, json.dumps(config))

            def time_us(config: dict, m: int) -> float:
                text = json.dumps(config)
                return graph_us([lambda layer=layer: HummingAhead.apply(layer, inputs[m], compute, text)
                                 for layer in layers])  # fmt: skip

            results[name] = search_layer(
                lambda config: HummingKernel.prepare_kernels(layer_config, compute, json.dumps(config), device),
                run, time_us, lambda m: _config_at(table, m), candidates, rows, _max_rel_diff)
            results[name]["layers"] = len(layers)
        except Exception as e:  # noqa: BLE001 - one layer config's failure is its entry, not the run's
            results[name] = {"status": f"failed: {type(e).__name__}: {e}"[:500]}
    return results
