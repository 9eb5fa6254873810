"""Humming's kernels compiled ahead for the engine's rows only (issue #55 item 4): the table cut, the background
compile and the per-layer plan, with stand-ins for Humming (its real kernels run in the GPU suite's ``vllm_layers``
part, ``test_single_lora_vllm.py``'s ``+ahead`` case)."""

from __future__ import annotations

import json
import logging
import threading

import pytest
from torch import nn

from qerl_trl.vllm_plugin.humming_ahead import ANY_ROWS, HummingAhead, KernelsAhead, cut_row_table, engine_row_table

TABLE = [[0, 8, {"b": 1}], [8, 64, {"b": 2}], [64, 4096, {"b": 3}], [4096, 8000, {"b": 4}], [8000, ANY_ROWS, {"b": 5}]]


def test_the_table_keeps_every_interval_a_budgeted_m_falls_in_and_the_last_serves_any_m():
    assert cut_row_table(TABLE, 4096) == [[0, 8, {"b": 1}], [8, 64, {"b": 2}], [64, ANY_ROWS, {"b": 3}]]
    assert cut_row_table(TABLE, 4097) == [*TABLE[:3], [4096, ANY_ROWS, {"b": 4}]]  # M = 4097 runs interval 4
    assert cut_row_table(TABLE, 1) == [[0, ANY_ROWS, {"b": 1}]]
    assert cut_row_table(TABLE, 10**9) == TABLE
    assert TABLE[2][1] == 4096, "the input table is left as it was"


def _kernel_for(table, m):
    """Humming's launcher: the interval with lo < m <= hi (humming 0.1.19 csrc/launcher/launcher.cpp)."""
    return next(config for lo, hi, config in table if lo < m <= hi)


@pytest.mark.parametrize("budget", [1, 8, 9, 100, 4096, 5000])
def test_a_cut_table_runs_the_same_kernel_as_the_whole_one_up_to_the_budget_and_some_kernel_past_it(budget):
    cut = cut_row_table(TABLE, budget)
    for m in [1, 2, 8, 9, 64, 65, 4096, 4097, 8000, 8001, 100000]:
        if m <= budget:
            assert _kernel_for(cut, m) == _kernel_for(TABLE, m), m
        else:
            assert _kernel_for(cut, m) is not None


def _real_7b_table() -> list:
    """Humming 0.1.19's table of 7B's gate/up layer on an H100 (``humming_tables`` of the e6d06c9 row in
    rollout-h100.json), each config given by its block shape."""
    from pathlib import Path

    rows = json.loads((Path(__file__).parents[1] / "benchmarks/results/rollout-h100.json").read_text())["rows"]
    tables = next(r["humming_tables"] for r in rows if isinstance(r.get("humming_tables"), dict))
    return [[lo, hi, tuple(block)] for lo, hi, block in tables["37888x3584"]["intervals"]]


@pytest.mark.parametrize("decode_rows", [16, 64])
def test_the_engine_table_keeps_the_decode_kernels_and_one_kernel_a_doubling_above(decode_rows):
    """On 7B's real table (92 intervals, 33 kernels, 27 block shapes): every decode batch up to max_num_seqs runs
    Humming's own kernel, every larger M up to the token budget one Humming tuned for at most twice its rows, any M
    some kernel; a few kernels where Humming's table has 33."""
    whole = _real_7b_table()
    assert len(whole) == 92 and len({c for _, _, c in whole}) == 27
    table = engine_row_table(whole, decode_rows, 4096)
    kernels = {c for _, _, c in table}
    assert len(kernels) <= decode_rows // 8 + 6, table  # Humming's decode kernels (8 rows apart) and the bands
    tuned_for = {c: [m for m in range(1, 8193) if _kernel_for(whole, m) == c] for c in kernels}
    for m in range(1, 4097):
        got = _kernel_for(table, m)
        if m <= decode_rows:
            assert got == _kernel_for(whole, m), m
        else:
            assert any(m <= t < 2 * m for t in tuned_for[got]), (m, got)
    assert _kernel_for(table, 10**6) is not None and table[-1][1] == ANY_ROWS
    assert all(a[2] != b[2] for a, b in zip(table, table[1:]))  # neighbours of one config merged


def test_an_engine_whose_decode_batch_reaches_its_token_budget_keeps_hummings_table_up_to_it():
    assert engine_row_table(TABLE, 4096, 4096) == cut_row_table(TABLE, 4096)
    assert engine_row_table(TABLE, 8, 8) == [[0, ANY_ROWS, {"b": 1}]]
    with pytest.raises(ValueError, match="decode_rows"):
        engine_row_table(TABLE, 0, 100)


def test_a_bad_budget_or_table_is_an_error():
    with pytest.raises(ValueError, match="max_rows"):
        cut_row_table(TABLE, 0)
    with pytest.raises(ValueError, match="no interval"):
        cut_row_table([[100, ANY_ROWS, {}]], 50)


def test_kernels_compile_once_a_key_on_a_background_thread_and_a_failure_never_reaches_the_engine(caplog):
    calls, threads = [], set()

    def prepare(*key):
        threads.add(threading.current_thread().name)
        calls.append(key)
        if key[0] == "bad":
            raise RuntimeError("nvrtc failed")

    ahead = KernelsAhead(prepare)
    assert ahead.submit("a", 1) and not ahead.submit("a", 1)
    assert ahead.submit("bad", 1) and ahead.submit("b", 2)
    with caplog.at_level(logging.INFO):
        ahead.wait()
    assert calls == [("a", 1), ("bad", 1), ("b", 2)]  # in order, the failure did not stop the next key
    assert threads == {"qerl-humming-ahead"}
    assert ahead.done == [("a", 1), ("b", 2)] and ahead.failed == [(("bad", 1), "RuntimeError('nvrtc failed')")]
    assert "compiles them at its first forward instead" in caplog.text
    # each compile's timing line, in the form benchmarks/e2e_step.py reads into a row's start-up phases
    from benchmarks.e2e_step import engine_log_phases

    assert caplog.text.count("compiled Humming's kernels ahead for layer config") == 2
    assert engine_log_phases(caplog.text)["humming_ahead_last_done_s"] >= 0


class _Meta:
    def __init__(self, text):
        self.text = text

    def to_str(self):
        return self.text


def _layer(config: str) -> nn.Module:
    layer = nn.Module()
    layer.humming_metas = {"": _Meta(config)}
    return layer


def test_layers_of_one_config_share_one_table_and_one_compile():
    tables, compiled = [], []
    ahead = HummingAhead(8, 100, KernelsAhead(lambda *key: compiled.append(key)),
                         table=lambda lc, cc, dev: tables.append((lc, cc)) or TABLE)  # fmt: skip
    plans = [ahead.plan(_layer(name), '{"gemm_type": "dense"}') for name in ("qkv", "o", "qkv", "qkv", "o")]
    ahead.kernels.wait()
    assert tables == [("qkv", '{"gemm_type": "dense"}'), ("o", '{"gemm_type": "dense"}')]
    want = json.dumps(engine_row_table(TABLE, 8, 100))
    assert json.loads(want) == [[0, 8, {"b": 1}], [8, 64, {"b": 2}], [64, ANY_ROWS, {"b": 3}]]
    assert plans == [want] * 5
    assert compiled == [("qkv", '{"gemm_type": "dense"}', want, 0), ("o", '{"gemm_type": "dense"}', want, 0)]


@pytest.mark.parametrize("table", [
    lambda lc, cc, dev: (_ for _ in ()).throw(RuntimeError("no GPU")),  # Humming cannot build it
    lambda lc, cc, dev: [[0, ANY_ROWS, {"dtype": object()}]],  # not JSON: Humming's forward could not take it
])  # fmt: skip
def test_a_table_that_cannot_be_had_leaves_the_layer_on_hummings_own_and_compiles_nothing(table, caplog):
    compiled = []
    ahead = HummingAhead(8, 100, KernelsAhead(lambda *key: compiled.append(key)), table=table)
    with caplog.at_level(logging.WARNING):
        assert ahead.plan(_layer("o"), "{}") is None
        assert ahead.plan(_layer("o"), "{}") is None
    ahead.kernels.wait()
    assert compiled == [] and caplog.text.count("keeps Humming's whole table") == 1


def test_the_tables_of_a_model_name_each_distinct_humming_layer_once(monkeypatch):
    from qerl_trl.vllm_plugin import humming_ahead

    small, large = {"block_shape": [16, 128, 64]}, {"block_shape": [64, 128, 64]}
    monkeypatch.setattr(humming_ahead, "_humming_table",
                        lambda lc, cc, dev: [[0, 8, small], [8, 4096, large], [4096, ANY_ROWS, large]])

    def linear(n, k, cut=None):
        layer = _layer(json.dumps({"shape_n": n, "shape_k": k}))
        chosen = type("Humming", (), {"compute_config": "{}"})()
        by_shape = type("ByShape", (), {"chosen": chosen, "tuning_config": cut})()
        layer.quant_method = type("Lora", (), {"inner": by_shape})()
        return layer

    model = nn.ModuleList([linear(4608, 3584), linear(3584, 3584, json.dumps(cut_row_table(TABLE, 8))),
                           linear(4608, 3584), nn.Linear(2, 2)])  # fmt: skip
    got = humming_ahead.humming_tables_of(model)
    assert list(got) == ["4608x3584", "3584x3584"]
    assert got["4608x3584"] == {"intervals": [[0, 8, [16, 128, 64]], [8, 4096, [64, 128, 64]],
                                              [4096, ANY_ROWS, [64, 128, 64]]], "kernels": 2, "cut": None}  # fmt: skip
    assert got["3584x3584"]["cut"] == 1


def test_the_humming_layers_of_a_model_are_grouped_by_layer_config_in_model_order():
    """``humming_layers``: every layer of one Humming config, in model order (a search times a config over all of
    them, so each call reads weights from HBM as a decode step does), with its compute config and method."""
    from qerl_trl.vllm_plugin.humming_ahead import humming_layers

    def linear(n, k):
        layer = _layer(json.dumps({"shape_n": n, "shape_k": k}))
        chosen = type("Humming", (), {"compute_config": '{"c": 1}'})()
        layer.quant_method = type("Lora", (), {"inner": type("ByShape", (), {"chosen": chosen})()})()
        return layer

    a1, b1, a2 = linear(4608, 3584), linear(3584, 3584), linear(4608, 3584)
    got = humming_layers(nn.ModuleList([a1, nn.Linear(2, 2), b1, a2]))
    assert [(json.loads(k)["shape_n"], c, layers) for k, (c, _, layers) in got.items()] == [
        (4608, '{"c": 1}', [a1, a2]), (3584, '{"c": 1}', [b1])]
