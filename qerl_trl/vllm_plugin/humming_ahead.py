"""Humming's kernels compiled ahead, and only those the engine's batch sizes need: issue #55 item 4, a cold start's
cut. Written against humming-kernels 0.1.19 and vLLM 0.24.0.

Why: Humming compiles one kernel per distinct config of its tuning table (92 row intervals from 1 to 8192 rows at
each 7B shape, 33 distinct kernels, every one of them below 512 rows: ``humming_tables`` in
``benchmarks/results/rollout-h100.json``) the first time a layer of a shape runs, one shape after the other, inside
vLLM's first forward: 133 kernels and about 80 s of a cold 7B trainer start on a 16-core H100 host (docs/vllm.md).
What is known earlier than that:

* the rows the engine's GEMMs get: decode batches up to its ``max_num_seqs`` (what a GRPO round spends its time on,
  Humming's own kernel for each), and prefill chunks up to its ``max_num_batched_tokens`` (one step or a few a
  round), so the table keeps Humming's intervals up to ``max_num_seqs`` and above it one kernel per doubling of the
  rows, Humming's own for the band's largest M, the last stretched to every larger M (:func:`engine_row_table`);
  cutting the table at the token budget alone (the first try) removed no kernel at 7B;
* each layer's Humming config, as soon as vLLM's Humming method has converted the layer's weights, so the kernels of
  every distinct layer compile on one background thread (:class:`KernelsAhead`) beside the rest of the load and
  vLLM's torch.compile, instead of inside the first forward.

Humming keys its compiled kernels by their code (on disk, under a file lock) and by the config strings (in memory),
so the forward finds what the thread compiled, and waits on the lock for a kernel still compiling. A failure here
only loses the head start: the forward compiles as it would have.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["KernelsAhead", "HummingAhead", "cut_row_table", "engine_row_budget", "engine_row_table",
           "humming_layers", "humming_tables_of"]

#: Humming's table entries end at this many rows for "every larger M" (humming 0.1.19 ``tune/base.py``)
ANY_ROWS = 1 << 30
#: the rows of a dense table's last interval when vLLM's config cannot be read (Humming's own dense table ends there)
HUMMING_DENSE_ROWS = 8192


def cut_row_table(table: Sequence[Sequence[Any]], max_rows: int) -> list[list[Any]]:
    """Humming's tuning table ``[[lo, hi, config], ...]`` (``config`` runs ``lo < M <= hi``) cut to the intervals
    that some ``M <= max_rows`` falls in, the last of them stretched to every larger M: the kernels an engine of
    that row budget can launch, and a kernel for any M."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    kept = [[lo, hi, config] for lo, hi, config in table if lo < max_rows]
    if not kept:
        raise ValueError(f"Humming's tuning table has no interval at or below {max_rows} rows: {table!r:.200}")
    kept[-1][1] = ANY_ROWS
    return kept


def _config_at(table: Sequence[Sequence[Any]], rows: int) -> Any:
    """The config Humming's launcher runs at ``rows`` rows (the interval with ``lo < rows <= hi``)."""
    for lo, hi, config in table:
        if lo < rows <= (hi if hi > 0 else ANY_ROWS):
            return config
    raise ValueError(f"Humming's tuning table has no interval holding {rows} rows: {table!r:.200}")


def engine_row_table(table: Sequence[Sequence[Any]], decode_rows: int, max_rows: int) -> list[list[Any]]:
    """Humming's table for an engine whose decode batches reach ``decode_rows`` and whose steps ``max_rows`` tokens:
    Humming's own intervals up to ``decode_rows``, then one interval a doubling of the rows up to ``max_rows``, each
    on Humming's config for its largest M, the last stretched to every larger M; neighbours of one config merged.
    The decode steps run exactly the kernels they ran before; a prefill chunk runs a kernel tuned for at most twice
    its rows."""
    if decode_rows < 1:
        raise ValueError(f"decode_rows must be >= 1, got {decode_rows}")
    if decode_rows >= max_rows:
        return cut_row_table(table, max_rows)
    out = [[lo, min(hi, decode_rows), config] for lo, hi, config in cut_row_table(table, decode_rows)]
    lo = decode_rows
    while lo < max_rows:
        hi = min(2 * lo, max_rows)
        out.append([lo, hi, _config_at(table, hi)])
        lo = hi
    merged: list[list[Any]] = []
    for entry in out:
        if merged and merged[-1][2] == entry[2]:
            merged[-1][1] = entry[1]
        else:
            merged.append(list(entry))
    merged[-1][1] = ANY_ROWS
    return merged


def engine_row_budget() -> tuple[int, int]:
    """``(decode_rows, max_rows)`` of the engine being built: vLLM's ``max_num_seqs`` (the largest decode batch) and
    ``max_num_batched_tokens`` (the scheduler's token budget a step). Read while vLLM builds the model."""
    from vllm.config import get_current_vllm_config

    scheduler = get_current_vllm_config().scheduler_config
    max_rows = int(getattr(scheduler, "max_num_batched_tokens", None) or HUMMING_DENSE_ROWS)
    decode_rows = int(getattr(scheduler, "max_num_seqs", None) or max_rows)
    return min(decode_rows, max_rows), max_rows


class KernelsAhead:
    """Runs ``prepare(*key)`` once for each distinct key, in order, on one daemon thread (Humming spreads one
    layer's kernels over its own compile workers). Never raises into the engine: a failure is logged once a key."""

    def __init__(self, prepare: Callable[..., Any]):
        self._prepare = prepare
        self._seen: set[tuple] = set()
        self._todo: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._first_queued: float | None = None
        self.done: list[tuple] = []
        self.failed: list[tuple[tuple, str]] = []

    def submit(self, *key: Any) -> bool:
        """Queue ``prepare(*key)`` unless this key was queued before; True if queued."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            if self._first_queued is None:
                self._first_queued = time.perf_counter()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="qerl-humming-ahead", daemon=True)
                self._thread.start()
        self._todo.put(key)
        return True

    def _work(self) -> None:
        while True:
            key = self._todo.get()
            try:
                t0 = time.perf_counter()
                self._prepare(*key)
                self.done.append(key)
                # INFO, read by benchmarks/e2e_step.py's start-up phases: how far ahead of the first forward it ran
                logger.info("qerl-trl: compiled Humming's kernels ahead for layer config %d of %d in %.1f s, %.1f s "
                            "after the first was queued", len(self.done), len(self._seen), time.perf_counter() - t0,
                            time.perf_counter() - self._first_queued)  # fmt: skip
            except Exception as e:  # the forward compiles it as it would have; say why the head start was lost
                self.failed.append((key, repr(e)))
                logger.warning("qerl-trl: compiling Humming's kernels ahead failed (%r); the engine compiles them at "
                               "its first forward instead", e)  # fmt: skip
            finally:
                self._todo.task_done()

    def wait(self) -> None:
        """Block until every queued key is done (tests; the engine itself never waits here)."""
        self._todo.join()


def _humming_prepare(layer_config: str, compute_config: str, tuning_config: str, device: int) -> Any:
    from humming.kernel.humming import HummingKernel

    return HummingKernel.prepare_kernels(layer_config, compute_config, tuning_config, device)


def _humming_table(layer_config: str, compute_config: str, device: int) -> list:
    """Humming's own tuning table for a layer, as its forward would build it with no table given (its private
    ``HummingKernel._resolve_configs`` of 0.1.19: the one place this module reaches into Humming)."""
    from humming.kernel.humming import HummingKernel

    _, _, table = HummingKernel._resolve_configs(layer_config, compute_config, None, device)
    return table


class HummingAhead:
    """What :class:`~.single_lora.FP4KernelByShape` asks of this module for a layer on Humming: the layer's cut
    table (:meth:`plan`, after vLLM's Humming method has converted the layer) and the forward that uses it
    (:meth:`apply`, vLLM 0.24 ``HummingLinearMethod.apply`` with ``tuning_config``). One per engine; the table and
    the background compile are shared by every layer of one Humming config."""

    def __init__(self, decode_rows: int, max_rows: int, kernels: KernelsAhead | None = None,
                 table: Callable[[str, str, int], list] | None = None):  # fmt: skip
        self.decode_rows = int(decode_rows)
        self.max_rows = int(max_rows)
        self.kernels = kernels or KernelsAhead(_humming_prepare)
        self._table = table or _humming_table
        self._cut: dict[tuple[str, str], str | None] = {}

    def plan(self, layer: nn.Module, compute_config: str) -> str | None:
        """The engine's table (:func:`engine_row_table`, a JSON string, as Humming's forward takes it) for ``layer``,
        its kernels queued for the background compile; None where the table cannot be had or written as JSON (the
        forward then runs as vLLM's does, Humming's whole table compiled at first use)."""
        layer_config = layer.humming_metas[""].to_str()
        key = (layer_config, compute_config)
        if key not in self._cut:
            device = torch.cuda.current_device() if torch.cuda.is_available() else 0
            try:
                whole = self._table(layer_config, compute_config, device)
                cut: str | None = json.dumps(engine_row_table(whole, self.decode_rows, self.max_rows))
            except Exception as e:
                logger.warning("qerl-trl: Humming's tuning table for a layer could not be fitted to %d decode rows and "
                               "%d-token steps (%r); that layer keeps Humming's whole table", self.decode_rows,
                               self.max_rows, e)  # fmt: skip
                cut = None
            self._cut[key] = cut
            if cut is not None:
                self.kernels.submit(layer_config, compute_config, cut, device)
        return self._cut[key]

    @staticmethod
    def apply(layer: nn.Module, x: torch.Tensor, compute_config: str, tuning_config: str) -> torch.Tensor:
        """vLLM 0.24 ``HummingLinearMethod.apply`` with the engine's table (the layer's bias is Humming's own)."""
        import vllm.utils.humming as _hm

        flat = x.view(-1, x.size(-1))
        out = _hm.HummingMethod.forward_layer(layer=layer, inputs=flat, compute_config=compute_config,
                                              tuning_config=tuning_config)  # fmt: skip
        return out.view(*x.shape[:-1], out.size(-1))


def humming_layers(model: nn.Module) -> dict[str, tuple[str, Any, list[nn.Module]]]:
    """``{layer config: (compute config, the layers' method, [layers])}`` of a vLLM model's Humming linears, in model
    order, one entry per distinct Humming layer config (its N x K and dtypes): what the engine compiles kernels for."""
    out: dict[str, tuple[str, Any, list[nn.Module]]] = {}
    for module in model.modules():
        metas = getattr(module, "humming_metas", None)
        method = getattr(module, "quant_method", None)
        method = getattr(method, "inner", method)  # SingleLoRALinearMethod over FP4KernelByShape
        compute = getattr(getattr(method, "chosen", method), "compute_config", None)
        if not isinstance(metas, dict) or "" not in metas or compute is None:
            continue
        out.setdefault(metas[""].to_str(), (compute, method, []))[2].append(module)
    return out


def humming_tables_of(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{"NxK": {"intervals": [[lo, hi, block_shape], ...], "kernels": n, "cut": m or None}}`` for each distinct
    Humming layer config of a vLLM model (run it with ``LLM.apply_model``): Humming's whole table for the layer (what
    a cold start compiles without the cut: one kernel per distinct config) and, where the layer runs the engine's table,
    its kernel count. For benchmark rows: which row intervals a cold start pays for."""
    out: dict[str, dict[str, Any]] = {}
    device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    for layer_config, (compute, method, _) in humming_layers(model).items():
        parsed = json.loads(layer_config)
        table = _humming_table(layer_config, compute, device)
        cut = getattr(method, "tuning_config", None)
        out[f"{parsed.get('shape_n')}x{parsed.get('shape_k')}"] = {
            "intervals": [[lo, hi, config.get("block_shape")] for lo, hi, config in table],
            "kernels": len({json.dumps(config, sort_keys=True, default=str) for _, _, config in table}),
            "cut": None if cut is None else len({json.dumps(c, sort_keys=True) for _, _, c in json.loads(cut)}),
        }
    return out
