"""The measured tables of README.md and docs/ must be the committed result files' rows (issue #25: "README's tables
come from them"; issue #56 moved most of them to docs/).

Each figure in the rollout tables (7B, 14B, 32B), the GRPO step tables of issue #25's settings, the several-GPU
tables and the decode-step profile is looked up in ``benchmarks/results/`` by the run the text names, and must round
to what is printed. A table edited by hand, or a result file re-merged without updating the page, fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: README.md and every docs/ page, one after another (a table's run is named in its own page's text above it)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README = "\n\n".join(p.read_text() for p in PAGES)
RUN = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{6}")
NUMBER = re.compile(r"\d+(?:\.\d+)?")

#: column -> (arm, FP4 kernel): "NVFP4" columns are the runs on Marlin, "Humming" ones on Humming
ROLLOUT_ARMS = {"merged BF16 (TRL)": ("bf16_merged", None), "NVFP4 + vLLM's LoRA": ("nvfp4_vllm_lora", "marlin"),
                'NVFP4 + `"qerl"`': ("nvfp4_qerl_lora", "marlin"), "NVFP4, no LoRA": ("nvfp4", "marlin"),
                "Humming + vLLM's LoRA": ("nvfp4_vllm_lora", "humming"),
                'Humming + `"qerl"`': ("nvfp4_qerl_lora", "humming"), "Humming, no LoRA": ("nvfp4", "humming")}
STEP_ARMS = {"TRL BF16 LoRA": ("trl_bf16", None), 'QeRL, `"vllm"`': ("qerl", None),
             'QeRL, `"qerl"` (default)': ("qerl_single_lora", None),
             'QeRL, `"qerl"` (default), Humming': ("qerl_single_lora", "humming"),
             "QeRL, today's defaults, Humming": ("qerl_single_lora", "humming")}  # fmt: skip
#: a step-table arm that claims today's defaults: its row must have run each of these options as the config's
#: default runs it at a 2 × 8 on-policy setting with the "qerl" backend (``None`` there means on)
DEFAULTS_ARM = "QeRL, today's defaults, Humming"
DEFAULT_OPTIONS = {"fused_is": "fused_importance_sampling", "humming_ahead": "vllm_humming_compile_ahead"}


def _default_on(field_name: str) -> bool:
    import dataclasses

    from qerl_trl import QeRLGRPOConfig

    (default,) = [f.default for f in dataclasses.fields(QeRLGRPOConfig) if f.name == field_name]
    return default is None or bool(default)


def _kernel(row: dict) -> str | None:
    """A rollout row's FP4 kernel (rows from before it was recorded ran on Marlin)."""
    return None if row["arm"] == "bf16_merged" else row.get("kernel") or "marlin"


def _rows(name: str) -> list[dict]:
    return json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"]


def _close(printed: str, value: float) -> bool:
    """``printed`` is ``value`` rounded to the digits it shows (half-way cases either way)."""
    decimals = len(printed.partition(".")[2])
    return abs(float(printed) - value) <= 0.5 * 10**-decimals + 1e-9


def _tables(header_start: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(the text before the table, header cells, body rows' cells) of each README table whose header starts so."""
    lines = README.splitlines()
    cells = lambda line: [c.strip().replace("**", "") for c in line.strip().strip("|").split("|")]  # noqa: E731
    out = []
    for i in (k for k, line in enumerate(lines) if line.startswith(header_start)):
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]  # a table inside a list item is indented
        body = []
        for line in lines[i + 2 :]:
            if not line.startswith(indent + "|"):
                break
            body.append(cells(line))
        out.append(("\n".join(lines[:i]), cells(lines[i]), body))
    return out


@pytest.mark.parametrize("size", ["7b", "14b", "32b"])
def test_rollout_tables_are_the_json_rows_of_the_run_they_name(size):
    tables = _tables(f"| {size.upper()}, batch |")
    assert tables, f"README has no {size} rollout table"
    arms_shown = set()
    for before, header, body in tables:  # a size's arms may be split over runs: one table per run
        run = RUN.findall(before.rstrip().split("\n\n")[-1])[0]  # the first run the paragraph above names
        rows = {(r["arm"], _kernel(r), r["batch"]): r for r in _rows("rollout-h100.json")
                if r["size"] == size and r.get("run") == run}  # fmt: skip
        assert rows, f"README's {size} rollout table names run {run}, which rollout-h100.json does not hold"
        checked = 0
        for cells in body:
            batch = int(cells[0])
            for col, cell in zip(header[1:], cells[1:]):
                row = rows[(*ROLLOUT_ARMS[col], batch)]
                assert row["status"] == "ok"
                figures = NUMBER.findall(cell)
                assert _close(figures[0], row["tokens_per_s"]), (size, col, batch, cell, row["tokens_per_s"])
                if "×" in cell:
                    assert _close(figures[1], row["vs_bf16_merged"]), (size, col, batch, cell, row["vs_bf16_merged"])
                assert ("KV-limited" in cell) == bool(row.get("kv_limited")), (size, col, batch, cell)
                arms_shown.add(ROLLOUT_ARMS[col][0])
                checked += 1
        assert checked >= 8
    missing = {arm for arm, _ in ROLLOUT_ARMS.values()} - arms_shown
    assert not missing, f"README's {size} rollout tables leave out {missing}"


def test_the_step_tables_are_the_json_rows_of_the_runs_they_name():
    tables = _tables("| setting | run (commit) |")
    assert len(tables) == 2, "README's headline step table and docs/benchmarks.md's"
    for _, header, body in tables:
        _check_step_table(header, body)


def _check_step_table(header: list[str], body: list[list[str]]) -> None:
    assert header == ["setting", "run (commit)", "arm", "step", "rollout / sync / rest", "peak", "× TRL BF16 LoRA"]
    rows = _rows("e2e_step-h100.json")
    setting = run = commit = None
    for cells in body:
        if cells[0]:
            p, g, n, sleep = re.fullmatch(r"(\d+) × (\d+) × (\d+), (no sleep|sleep)", cells[0]).groups()
            setting = (int(p), int(g), int(n), sleep == "sleep")
            run, commit = re.fullmatch(r"(\S+) \((\w+)\)", cells[1]).groups()
        arm, kernel = STEP_ARMS[cells[2]]
        (row,) = [r for r in rows if r.get("run") == run and r["arm"] == arm and r["size"] == "7b"
                  and (r["prompts"], r["generations"], r["completion_len"], r["sleep"]) == setting]  # fmt: skip
        assert row["status"] == "ok" and row["commit"].startswith(commit), (run, arm)
        assert kernel is None or row.get("fp4_kernel") == kernel, (run, arm, row.get("fp4_kernel"))
        if cells[2] == DEFAULTS_ARM:
            for key, field_name in DEFAULT_OPTIONS.items():
                assert bool(row.get(key)) == _default_on(field_name), (run, arm, key)
        step, low, high = NUMBER.findall(cells[3])
        assert _close(step, row["step_s"]) and _close(low, row["step_s_min"]) and _close(high, row["step_s_max"])
        rollout, sync, rest = NUMBER.findall(cells[4])
        assert _close(rollout, row["rollout_s"]) and _close(sync, row["sync_s"]) and _close(rest, row["train_s"])
        assert _close(NUMBER.findall(cells[5])[0], row["peak_gib"]), (run, arm, cells[5], row["peak_gib"])
        assert _close(NUMBER.findall(cells[6])[0], row["speedup_vs_trl_bf16"]), (run, arm, cells[6])


def _assert_layout_cells(cells: list[str], row: dict) -> None:
    """A several-GPU table's first five cells (layout, GPUs, step, tokens/s, vs one GPU) are ``row``'s."""
    assert int(cells[1]) == row["gpus"], cells
    assert _close(cells[2], row["step_s"]) and _close(cells[3], row["tokens_per_s"]), (cells, row)
    assert _close(cells[4].rstrip("x"), row["tokens_per_s_vs_1gpu"]), (cells, row)


def test_the_multi_gpu_table_is_the_committed_rows():
    """Issue #39: README's several-GPU table is ``multi_gpu-h100x2.json`` (one device call), row by row."""
    modes = {"one GPU, colocate": "1gpu", "DDP x2, colocate": "ddp2",
             "server (trainer GPU 0, server GPU 1)": "server"}  # fmt: skip
    rows = {r["mode"]: r for r in _rows("multi_gpu-h100x2.json")}
    (_, header, body), = _tables("| layout |")
    assert header[:6] == ["layout", "GPUs", "step (s)", "completion tokens/s", "vs one GPU", "peak GiB per GPU"]
    assert len(body) == 3
    for cells in body:
        row = rows[modes[cells[0]]]
        _assert_layout_cells(cells, row)
        assert _close(NUMBER.search(cells[5]).group(), row["peak_gib_per_gpu"][0]), (cells, row)
    assert rows["ddp2"]["checks"]["lora_same_on_every_rank"] and rows["ddp2"]["checks"]["aqn_same_on_every_rank"]
    assert rows["server"]["checks"]["server_fp4_base_untouched"]


def test_the_14b_tensor_parallel_table_is_the_committed_rows():
    """Issue #39's ``tp2`` measurement: README's 14B table is the rows of ``multi_gpu-h200x2.json`` from the call the
    paragraph above it names (both modes of one call, at its commit), row by row."""
    ((before, header, body),) = _tables("| 14B layout |")
    commit = re.findall(r"one device call at ([0-9a-f]{7})", before.rstrip().split("\n\n")[-1])[0]
    modes = {"one GPU, colocate": "1gpu", "TP x2, colocate (one engine over both GPUs)": "tp2"}
    rows = {r["mode"]: r for r in _rows("multi_gpu-h200x2.json")
            if r["commit"].startswith(commit) and r.get("size") == "14b" and r.get("tokens_per_s")}  # fmt: skip
    assert set(rows) == {"1gpu", "tp2"}, f"multi_gpu-h200x2.json holds no measured 1gpu and tp2 rows at {commit}"
    assert len({r["command"] for r in rows.values()}) == 1  # one call: the ratio's baseline is from the same run
    assert header == ["14B layout", "GPUs", "step (s)", "completion tokens/s", "vs one GPU", "peak GiB per GPU",
                      "trainer start (s)"]  # fmt: skip
    assert len(body) == 2
    for cells in body:
        row = rows[modes[cells[0]]]
        _assert_layout_cells(cells, row)
        assert _close(cells[5], max(row["peak_gib_per_gpu"])) and _close(cells[6], row["init_s"]), (cells, row)
    tp2 = rows["tp2"]["checks"]
    assert tp2["lora_same_on_every_rank"] and tp2["aqn_same_on_every_rank"] and tp2["noise_free_logprob_gap_ok"]
    assert rows["tp2"]["status"] == "ok"


def test_the_decode_profile_table_is_the_json_rows():
    """Issue #55 item 3: the decode-step table of docs/benchmarks.md is what ``decode_profile.py`` prints from the
    committed rows, and the page names the run they came from."""
    from benchmarks.decode_profile import table

    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for name in ("rollout-h200.json", "rollout-h100.json"):
        result = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
        assert table(result["rows"]) in text, name
        runs = {r["run"] for r in result["rows"] if r.get("decode_profile")}
        assert runs and all(run in text for run in runs), name


def test_the_readme_decode_step_table_is_the_h100_profile_rows():
    """README's short decode-step table: each cell from the H100 profile row of that batch in the run it names."""
    (before, header, body), = _tables("| 7B decode, batch |")
    run = re.findall(r"run (\S+) of \[`rollout-h100.json`\]", before)[-1]
    rows = {r["batch"]: r["decode_profile"] for r in _rows("rollout-h100.json")
            if r.get("run") == run and r.get("decode_profile")}  # fmt: skip
    assert header[1:] == ["step", "FP4 GEMMs (TB/s)", "LoRA", "attention", "GPU waiting on the host"]
    assert [int(cells[0]) for cells in body] == [16, 64]
    for cells in body:
        p = rows[int(cells[0])]
        gemm, tbps = re.fullmatch(r"(\S+) \((\S+)\)", cells[2]).groups()
        ms = p["ms_by_category"]
        assert _close(cells[1], p["step_ms"]) and _close(gemm, ms["fp4_gemm"]), cells
        assert _close(tbps, p["fp4_gemm_gb_per_s"] / 1000), cells
        assert _close(cells[3], ms["lora"]) and _close(cells[4], ms["attention"]), cells
        assert _close(cells[5], p["host_gap_ms"]), cells


def test_the_fused_pass_table_is_the_json_rows():
    ((before, header, body),) = _tables("| fused pass | run (commit) |")
    assert header == ["fused pass", "run (commit)", "step", "rollout / sync / training pass", "peak"]
    rows = _rows("e2e_step-h200.json")
    for cells in body:
        run, commit = re.fullmatch(r"(\S+) \((\w+)\)", cells[1]).groups()
        fused = cells[0] == "on"
        (row,) = [r for r in rows if r.get("run") == run and bool(r.get("fused_is")) == fused]
        assert row["status"] == "ok" and row["commit"].startswith(commit) and row["arm"] == "qerl_single_lora"
        step, low, high = NUMBER.findall(cells[2])
        assert _close(step, row["step_s"]) and _close(low, row["step_s_min"]) and _close(high, row["step_s_max"])
        rollout, sync, rest = NUMBER.findall(cells[3])
        assert _close(rollout, row["rollout_s"]) and _close(sync, row["sync_s"]) and _close(rest, row["train_s"])
        assert _close(NUMBER.findall(cells[4])[0], row["peak_gib"])
    assert len(body) == 2


def test_the_fused_pass_beside_trl_table_is_the_json_rows():
    ((before, header, body),) = _tables("| 7B setting, arm |")
    assert header[1:] == ["run (commit)", "step", "rollout / sync / training pass", "peak", "TRL ÷ this"]
    rows = _rows("e2e_step-h200.json")
    arms = {"TRL BF16 LoRA": ("trl_bf16", False), "QeRL, fused pass off": ("qerl_single_lora", False),
            "QeRL, fused pass on": ("qerl_single_lora", True)}  # fmt: skip
    for cells in body:
        setting, arm_text = cells[0].split(": ")
        shape = re.fullmatch(r"(\d+) × (\d+) × (\d+), (sleep|no sleep)", setting)
        prompts, generations, length, sleep = shape.groups()
        run, commit = re.fullmatch(r"(\S+) \((\w+)\)", cells[1]).groups()
        arm, fused = arms[arm_text]
        (row,) = [r for r in rows if r.get("run") == run and r["arm"] == arm and bool(r.get("fused_is")) == fused]
        assert row["status"] == "ok" and row["commit"].startswith(commit) and row["size"] == "7b"
        assert (row["prompts"], row["generations"], row["completion_len"], row["sleep"]) == (
            int(prompts), int(generations), int(length), sleep == "sleep")
        step, low, high = NUMBER.findall(cells[2])
        assert _close(step, row["step_s"]) and _close(low, row["step_s_min"]) and _close(high, row["step_s_max"])
        rollout, sync, rest = NUMBER.findall(cells[3])
        assert _close(rollout, row["rollout_s"]) and _close(sync, row["sync_s"]) and _close(rest, row["train_s"])
        assert _close(NUMBER.findall(cells[4])[0], row["peak_gib"])
        assert _close(NUMBER.findall(cells[5])[0], row["speedup_vs_trl_bf16"])
    assert len(body) == 8


def test_the_moe_rollout_table_is_the_json_rows():
    ((before, header, body),) = _tables("| 30B-A3B, batch |")
    assert header == ["30B-A3B, batch", "merged BF16", "NVFP4 (Marlin MoE)"]
    run = RUN.findall(before.rstrip().split("\n\n")[-1])[0]
    rows = {(r["arm"], r["batch"]): r for r in _rows("rollout-h200.json")
            if r["size"] == "30b-a3b" and r.get("run") == run and r.get("kernel") in (None, "marlin")}  # fmt: skip
    for cells in body:
        batch = int(cells[0])
        bf16, fp4 = rows[("bf16_merged", batch)], rows[("nvfp4", batch)]
        assert bf16["status"] == fp4["status"] == "ok"
        assert _close(cells[1], bf16["tokens_per_s"])
        tps, ratio = NUMBER.findall(cells[2])
        assert _close(tps, fp4["tokens_per_s"]) and _close(ratio, fp4["vs_bf16_merged"])
        assert fp4["expert_kernels"] == {"CompressedTensorsW4A4Nvfp4MoEMethod (MarlinExperts)": 48}
    assert len(body) == 3


def test_the_moe_step_table_is_the_json_rows():
    ((before, header, body),) = _tables("| 30B-A3B arm |")
    assert header[1:] == ["run (commit)", "step", "rollout / sync / training pass", "peak", "trainer start"]
    rows = [r for r in _rows("e2e_step-h200.json") if r["size"] == "30b-a3b"]
    qerl, trl = body
    run, commit = re.fullmatch(r"(\S+) \((\w+)\)", qerl[1]).groups()
    (row,) = [r for r in rows if r.get("run") == run and r["arm"] == "qerl_single_lora"]
    assert row["status"] == "ok" and row["commit"].startswith(commit) and row["sleep"] and row["card_gib"] == 80
    step, low, high = NUMBER.findall(qerl[2])
    assert _close(step, row["step_s"]) and _close(low, row["step_s_min"]) and _close(high, row["step_s_max"])
    parts = zip(NUMBER.findall(qerl[3]), ("rollout_s", "sync_s", "train_s"), strict=True)
    assert all(_close(c, row[k]) for c, k in parts)
    assert _close(NUMBER.findall(qerl[4])[0], row["peak_gib"]) and _close(NUMBER.findall(qerl[5])[0], row["init_s"])
    (oom,) = [r for r in rows if r["arm"] == "trl_bf16" and r["commit"].startswith(trl[1].split("(")[1][:7])]
    assert oom["status"].startswith("oom") and trl[2] == "out of memory" and _close(trl[5].split()[0], oom["init_s"])


def test_the_moe_expert_pass_table_is_the_json_rows():
    ((before, header, body),) = _tables("| tokens | arm | forward |")
    arms = {"BF16, transformers' grouped GEMM (TRL's arm)": "bf16_grouped_mm",
            "BF16, transformers' per-expert loop": "bf16_eager", "NVFP4, grouped (QeRL)": "nvfp4_grouped",
            "NVFP4, per-expert loop": "nvfp4_loop"}  # fmt: skip
    rows = {(r["tokens"], r["arm"]): r for r in _rows("moe_expert_pass-h200.json")}
    for cells in body:
        row = rows[(int(cells[0]), arms[cells[1]])]
        assert row["status"] == "ok"
        assert _close(NUMBER.findall(cells[2])[0], row["fwd_ms"])
        total, low, high = NUMBER.findall(cells[3])
        assert _close(total, row["fwd_bwd_ms"]) and _close(low, row["fwd_bwd_ms_min"])
        assert _close(high, row["fwd_bwd_ms_max"]) and _close(NUMBER.findall(cells[4])[0], row["peak_gib"])
    assert len(body) == len(rows) == 8


def _check_step_cells(cells: list[str], row: dict) -> None:
    """Cells 2-3 of a step table: the step with its min-max, and rollout / sync / training pass."""
    step, low, high = NUMBER.findall(cells[2])
    assert _close(step, row["step_s"]) and _close(low, row["step_s_min"]) and _close(high, row["step_s_max"])
    rollout, sync, rest = NUMBER.findall(cells[3])
    assert _close(rollout, row["rollout_s"]) and _close(sync, row["sync_s"]) and _close(rest, row["train_s"])


def test_the_h100_step_tables_are_the_json_rows():
    """Issue #55 item 5 (7B beside TRL) and #54 (30B-A3B beside a 7B row) on one H100: every cell from its row."""
    rows = _rows("e2e_step-h100.json")
    ((_, header, body),) = _tables("| H100 7B setting, arm |")
    assert header[1:] == ["run (commit)", "step", "rollout / sync / training pass", "peak", "TRL ÷ this"]
    arms = {"TRL BF16 LoRA": ("trl_bf16", False), "QeRL, fused pass on": ("qerl_single_lora", True),
            "QeRL": ("qerl_single_lora", False)}
    for cells in body:
        setting, arm_text = cells[0].split(": ")
        run, commit = re.fullmatch(r"(\S+) \((\w+)\)", cells[1]).groups()
        arm, fused = arms[arm_text]
        (row,) = [r for r in rows if r.get("run") == run and r["arm"] == arm and bool(r.get("fused_is")) == fused
                  and r["status"] == "ok"]  # fmt: skip
        assert row["commit"].startswith(commit) and setting == "2 × 8 × 512, no sleep" and not row["sleep"]
        _check_step_cells(cells, row)
        assert _close(NUMBER.findall(cells[4])[0], row["peak_gib"])
        assert _close(NUMBER.findall(cells[5])[0], row["speedup_vs_trl_bf16"])
    assert len(body) == 4
    ((_, header, body),) = _tables("| H100 arm |")
    assert header[1:] == ["run (commit)", "step", "rollout / sync / training pass", "peak (rollout / training)",
                          "trainer start"]  # fmt: skip
    for cells in body:
        size = {"30B-A3B": "30b-a3b", "7B": "7b"}[cells[0].split(",")[0]]
        run, commit = re.fullmatch(r"(\S+) \((\w+)\)", cells[1]).groups()
        (row,) = [r for r in rows if r.get("run") == run and r["size"] == size and r["arm"] == "qerl_single_lora"]
        assert row["status"] == "ok" and row["commit"].startswith(commit)
        assert row["fused_is"] == ("fused pass" in cells[0])
        assert row["sleep"] == ("no sleep" not in cells[0])
        _check_step_cells(cells, row)
        rollout_peak, train_peak = NUMBER.findall(cells[4])
        assert _close(rollout_peak, row["peak_gib_by_phase"]["rollout"])
        assert _close(train_peak, row["peak_gib_by_phase"]["train"])
        assert _close(NUMBER.findall(cells[5])[0], row["init_s"])
    assert len(body) == 2


def test_the_h100_expand_in_gemm_table_is_its_runs_rows():
    """Issue #55's first whole steps of vllm_lora_expand_in_gemm (one H100 run): each arm's step, phases, peak and
    range of per-step mean log-prob gaps from its row."""
    run = "20261127T225643Z-266d6b"
    rows = [r for r in _rows("e2e_step-h100.json") if r.get("run") == run and r["arm"] == "qerl_single_lora"]
    ((_, header, body),) = _tables("| H100 7B 2 × 8 × 512, no sleep, arm |")
    assert header[1:] == ["step", "rollout / sync / training pass", "peak", "log-prob gap a step (mean)"]
    arms = {"QeRL, expand in the GEMM": True, "QeRL as shipped (the LoRA pair)": False}
    for cells in body:
        (row,) = [r for r in rows if r["expand_in_gemm"] == arms[cells[0]]]
        assert row["status"] == "ok" and not row["sleep"] and not row["fused_is"]
        _check_step_cells(["", *cells], row)
        assert _close(NUMBER.findall(cells[3])[0], row["peak_gib"])
        low, high = NUMBER.findall(cells[4])
        gaps = row["logp_gap_mean_per_step"]
        assert _close(low, min(gaps)) and _close(high, max(gaps))
    assert len(body) == 2


def test_the_h100_host_target_table_is_the_json_rows():
    """Issue #55's four target settings in one call on a 4-H100 host (one setting a GPU, its arms back to back): every
    cell from its row, the arm's options from the row's flags, and each ratio against the TRL row of its own run."""
    rows = _rows("e2e_step-h100.json")
    ((_, header, body),) = _tables("| H100 host 7B setting, arm |")
    assert header[1:] == ["run (commit)", "step", "rollout / sync / training pass", "peak", "TRL ÷ this"]
    arms = {"TRL BF16 LoRA": ("trl_bf16", False, False), "QeRL as shipped": ("qerl_single_lora", False, False),
            "QeRL, fused pass": ("qerl_single_lora", True, False),
            "QeRL, fused pass + expand": ("qerl_single_lora", True, True)}
    settings = set()
    for cells in body:
        setting, arm_text = cells[0].split(": ")
        shape, sleep = setting.split(", ")
        prompts, generations, length = map(int, shape.split(" × "))
        run, commit = re.fullmatch(r"(\S+) \((\w+)\)", cells[1]).groups()
        arm, fused, expand = arms[arm_text]
        (row,) = [r for r in rows if r.get("run") == run and r["arm"] == arm and bool(r.get("fused_is")) == fused
                  and bool(r.get("expand_in_gemm")) == expand]  # fmt: skip
        assert row["status"] == "ok" and row["commit"].startswith(commit)
        assert (row["prompts"], row["generations"], row["completion_len"], row["sleep"]) == (
            prompts, generations, length, sleep == "sleep")
        _check_step_cells(cells, row)
        assert _close(NUMBER.findall(cells[4])[0], row["peak_gib"])
        assert _close(NUMBER.findall(cells[5])[0], row["speedup_vs_trl_bf16"])
        settings.add(setting)
    assert len(body) == 11 and len(settings) == 4


def test_the_h100_expand_rollout_table_is_the_json_rows():
    """The rollout A/B of the expand in Humming's GEMM against the LoRA pair (one call): each cell from its row."""
    rows = [r for r in _rows("rollout-h100.json") if r.get("run") == "d513e85-h100x4-callA" and r["status"] == "ok"]
    ((_, header, body),) = _tables("  | H100 7B batch |")
    assert header[1:] == ['`"qerl"` as shipped (the pair)', "expand in the GEMM", "expand ÷ pair"]
    for cells in body:
        batch = int(cells[0])
        (pair,) = [r for r in rows if r["arm"] == "nvfp4_qerl_lora" and r["batch"] == batch]
        (expand,) = [r for r in rows if r["arm"] == "nvfp4_qerl_lora_expand" and r["batch"] == batch]
        assert _close(cells[1], pair["tokens_per_s"]) and _close(cells[2], expand["tokens_per_s"])
        assert _close(NUMBER.findall(cells[3])[0], expand["tokens_per_s"] / pair["tokens_per_s"])
    assert [int(c[0]) for c in body] == [1, 16, 64, 128]


def test_the_8x8_rollout_profile_table_is_the_json_rows():
    """The GPU time of one profiled 8 x 8 x 512 rollout round, QeRL against TRL (one call): each cell from its row's
    ``rollout_profile``."""
    ((before, header, body),) = _tables("  | 8 × 8 × 512 round, GPU ms |")
    run = RUN.findall(before)[-1]
    rows = {r["arm"]: r["rollout_profile"] for r in _rows("e2e_step-h200.json") if r.get("run") == run}
    assert header[1:] == ["QeRL", "TRL BF16 LoRA"] and set(rows) == {"qerl_single_lora", "trl_bf16"}
    keys = {"FP4 GEMMs (Humming)": "fp4_gemm", "LoRA (shrink and expand)": "lora",
            "cuBLAS GEMMs (the lm_head; for TRL every linear)": "logits_gemm", "attention": "attention",
            "norms, rope, activation": "norm_rope_act", "copies": "copy", "sampling": "sampling",
            "GPU busy": None}  # fmt: skip
    assert [c[0] for c in body] == list(keys)
    for cells in body:
        for printed, arm in zip(cells[1:], ("qerl_single_lora", "trl_bf16"), strict=True):
            p = rows[arm]
            value = p["gpu_busy_ms"] if keys[cells[0]] is None else p["ms_by_category"].get(keys[cells[0]])
            assert (printed == "–") if value is None else _close(printed, value), (cells[0], arm)
