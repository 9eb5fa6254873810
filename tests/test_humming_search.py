"""``benchmarks/humming_search.py``: Humming's configs at decode rows, timed against its heuristic's, on CPU with a
fake kernel (the GPU run is ``rollout.py --humming-search-rows``)."""

from __future__ import annotations

import json
import threading

import pytest

from benchmarks import humming_search as hs
from benchmarks import rollout


def _fake(times: dict[str, dict[int, float]], wrong: set[str] = frozenset(), broken: set[str] = frozenset()):
    """A kernel whose configs are ``{"id": name}``: its time at each row count from ``times``, a wrong output for
    ``wrong`` and a compile error for ``broken``; records what was compiled and on which threads."""
    seen = {"compiled": [], "threads": set(), "ran": []}

    def compile_config(config):
        seen["threads"].add(threading.current_thread().name)
        if config["id"] in broken:
            raise RuntimeError(f"nvrtc: {config['id']} does not fit")
        seen["compiled"].append(config["id"])

    def run(config, m):
        seen["ran"].append((config["id"], m))
        return 1.0 if config["id"] in wrong else 0.0

    return seen, compile_config, run, lambda config, m: times[config["id"]][m]


def test_the_fastest_correct_compiled_config_wins_at_each_row_count_and_the_heuristic_is_the_baseline():
    times = {"h16": {16: 10.0}, "h64": {64: 40.0}, "a": {16: 8.0, 64: 45.0}, "b": {16: 5.0, 64: 20.0},
             "c": {16: 1.0, 64: 1.0}, "d": {16: 1.0, 64: 1.0}}  # fmt: skip
    seen, compile_config, run, time_us = _fake(times, wrong={"c"}, broken={"d"})
    candidates = [{"id": "a"}, {"id": "b"}, {"id": "c"}, {"id": "d"}, {"id": "a"}]  # "a" twice: compiled once
    got = hs.search_layer(compile_config, run, time_us, lambda m: {"id": f"h{m}"}, candidates, [16, 64],
                          lambda out, ref: abs(out - ref), workers=3)  # fmt: skip
    assert sorted(seen["compiled"]) == ["a", "b", "c"] and got["candidates"] == 4
    assert len(got["compile_failed"]) == 1 and "d does not fit" in got["compile_failed"][0]
    assert got["rows"]["16"] == {"heuristic_us": 10.0, "heuristic_config": {"id": "h16"}, "best_us": 5.0,
                                 "best_config": {"id": "b"}, "speedup": 2.0, "timed": 2, "wrong": 1}  # fmt: skip
    assert got["rows"]["64"]["best_config"] == {"id": "b"} and got["rows"]["64"]["speedup"] == 2.0
    assert ("c", 16) in seen["ran"]  # run, found wrong, never timed: its 1.0 µs did not win
    json.dumps(got)  # a row's field


def test_where_nothing_beats_the_heuristic_it_stays_the_best():
    seen, compile_config, run, time_us = _fake({"h": {32: 3.0}, "a": {32: 4.0}})
    got = hs.search_layer(compile_config, run, time_us, lambda m: {"id": "h"}, [{"id": "a"}], [32],
                          lambda out, ref: 0.0)  # fmt: skip
    assert got["rows"]["32"]["best_config"] == {"id": "h"} and got["rows"]["32"]["speedup"] == 1.0


def test_the_output_check_takes_a_relative_gap_and_refuses_a_non_finite_output():
    torch = pytest.importorskip("torch")
    ref = torch.tensor([[2.0, -4.0]])
    assert hs._max_rel_diff(torch.tensor([[2.0, -3.96]]), ref) == pytest.approx(0.01)
    assert hs._max_rel_diff(torch.tensor([[float("nan"), -4.0]]), ref) == float("inf")
    assert hs._max_rel_diff(ref.to(torch.bfloat16), ref) == 0.0


def test_rollout_passes_the_search_rows_to_each_engine(tmp_path, monkeypatch):
    """``rollout.py --humming-search-rows 16 64``: each engine's spec carries them (a Humming arm searches after its
    timed batches); the child rebuilds them as a tuple."""
    from benchmarks import _child, e2e_step

    monkeypatch.setattr(e2e_step, "prepare_checkpoints", lambda *a, **k: None)
    specs = []

    def fake_run_child(cmd, timeout, log_path=None, env=None):
        spec = json.loads(cmd[cmd.index("--child") + 1])
        specs.append(spec)
        rows = [dict(size=spec["size"], arm=spec["arm"], batch=b, status="ok", tokens_per_s=1.0)
                for b in spec["batches"]]  # fmt: skip
        with open(cmd[cmd.index("--rows-out") + 1], "w") as f:
            json.dump(rows, f)
        return _child.ChildResult(0, False, timeout, "", 1.0)

    monkeypatch.setattr(_child, "run_child", fake_run_child)
    rollout.main(["--sizes", "7b", "--arms", "nvfp4_qerl_lora@humming", "--batches", "16", "--humming-search-rows",
                  "16", "64", "--work", str(tmp_path), "--out-dir", str(tmp_path / "out")])  # fmt: skip
    assert specs[0]["search_rows"] == [16, 64] and specs[0]["kernel"] == "humming"
    got = []
    monkeypatch.setattr(rollout, "run_engine", lambda spec, work: got.append(spec) or [])
    rollout.main(["--child", json.dumps(specs[0]), "--work", str(tmp_path), "--rows-out", str(tmp_path / "r.json")])
    assert got[0].search_rows == (16, 64) and got[0].batches == (16,)
