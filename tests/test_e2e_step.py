"""CPU smoke run of ``benchmarks/e2e_step.py``: both kinds of arm train on a tiny Qwen2-shaped random model with
the training model's own generation, rows carry every field, failures become rows, and runs merge into one result
file. The real numbers come from the GPU machine (``benchmarks/results/e2e_step-h100.json``)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import e2e_step as e2e  # noqa: E402

ROW_KEYS = {"size", "arm", "prompts", "generations", "completion_len", "sleep", "step_s", "rollout_s", "sync_s",
            "train_s", "status"}


@pytest.fixture
def tiny(monkeypatch):
    from benchmarks import random_models as rm

    cfg = rm.qwen25_config("qwen2.5-1.5b", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    monkeypatch.setitem(e2e.SIZES, "tiny", cfg)
    monkeypatch.setitem(e2e.GPU_MEMORY_UTILIZATION, "tiny", 0.3)
    monkeypatch.setattr(e2e, "BF16_MAX_SIZE", (*e2e.BF16_MAX_SIZE, "tiny"))
    monkeypatch.setattr(e2e, "PROMPT_TOKENS", 12)
    return "tiny"


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["qerl", "trl_bf16"])
def test_an_arm_trains_and_reports_a_full_row(tiny, arm, tmp_path, monkeypatch):
    monkeypatch.setenv("QERL_E2E_PROFILE_ROLLOUT", "2")  # step 2's rollout under torch's profiler
    work = str(tmp_path)
    e2e.prepare_checkpoints(work, tiny, need_bf16=arm != "qerl")
    spec = e2e.RowSpec(tiny, arm, prompts=2, generations=4, completion_len=6, sleep=False, generation="hf")
    row = e2e.run_row(spec, work, steps=3)
    assert ROW_KEYS <= set(row), row
    # a random model rarely samples EOS; when it does, the equal-work check says so instead of passing
    assert row["status"] == "ok" or row["status"].startswith("check_failed: completion lengths"), row
    assert len(row["step_s_per_step"]) == 3 and row["step_s"] > 0 and row["rollout_s"] > 0
    assert row["step_s_min"] <= row["step_s"] <= row["step_s_max"]
    assert row["sync_s"] == 0.0  # no vLLM: nothing to sync
    assert abs(row["step_s"] - (row["rollout_s"] + row["sync_s"] + row["train_s"])) < 1e-2
    assert all(x is not None for x in row["losses"]) and row["tokens_per_step"] == 2 * 4 * 6
    prof = row["rollout_profile"]  # no GPU here: the round's wall time, and no kernel
    assert prof["step"] == 2 and prof["wall_ms"] > 0 and prof["gpu_busy_ms"] == 0 and prof["top_kernels"] == []
    assert prof["wall_ms"] >= 1000 * row["rollout_s_per_step"][1] * 0.5


def test_32b_bf16_rows_are_recorded_not_run(tmp_path):
    row = e2e.run_row(e2e.RowSpec("32b", "trl_bf16", 1, 8, 2048, True), str(tmp_path), steps=5)
    assert row["status"].startswith("not_run: a 32B BF16 checkpoint")


def test_card_gib_gives_vllm_the_memory_of_the_smaller_card(monkeypatch, tmp_path):
    """vLLM's KV cache is a share of the whole card: on a 140 GiB H200, "does 32B fit an 80 GB card" takes the share
    that gives vLLM an H100's GiB (0.45 x 79.2 GiB), not 0.45 of the H200; no card_gib, or a card no larger, keeps
    the size's share."""
    import torch

    assert e2e.vllm_memory_utilization("32b") == 0.45
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for total, want in ((140.0, 0.45 * 79.2 / 140.0), (79.2, 0.45), (47.5, 0.45)):
        props = type("Props", (), {"total_memory": int(total * 2**30)})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _i, p=props: p)
        assert e2e.vllm_memory_utilization("32b", e2e.H100_80GB_GIB) == pytest.approx(want, abs=1e-4)
        assert e2e.vllm_memory_utilization("32b") == 0.45
        row = e2e.run_row(e2e.RowSpec("32b", "trl_bf16", 1, 8, 2048, True), str(tmp_path), steps=5, card_gib=79.2)
        assert row["card_gib"] == 79.2 and row["vllm_gpu_memory_utilization"] == pytest.approx(want, abs=1e-4)


def test_failures_are_classified():
    assert e2e._classify(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")).startswith("oom: ")
    assert e2e._classify(ValueError("No available memory for the cache blocks. Try increasing "
                                    "`gpu_memory_utilization`")).startswith("oom: ")
    assert e2e._classify(KeyError("x")).startswith("failed: KeyError")


def test_matrix_names_are_unique_and_selectable():
    names = [s.name for s in e2e.default_matrix()]
    assert len(names) == len(set(names))
    assert {s.arm for s in e2e.default_matrix()} == set(e2e.DEFAULT_ARMS)
    picked = e2e.select(e2e.default_matrix(), ["7b"], ["qerl"], ["8x8-512-sleep"])
    assert [s.name for s in picked] == ["7b/qerl/8x8-512-sleep"]
    # both QeRL LoRA backends run on the same settings
    both = e2e.select(e2e.default_matrix(), ["7b"], ["qerl", "qerl_single_lora"], ["2x8-512-nosleep"])
    assert [s.name for s in both] == ["7b/qerl/2x8-512-nosleep", "7b/qerl_single_lora/2x8-512-nosleep"]
    assert set(e2e.QERL_ARMS) | set(e2e.DEFAULT_ARMS) == set(e2e.ARMS)


def test_speedups_only_within_one_run():
    base = dict(size="7b", prompts=2, generations=8, completion_len=512, sleep=False, status="ok")
    rows = [dict(base, arm="trl_bf16", step_s=6.0, run="r1"), dict(base, arm="qerl", step_s=4.0, run="r1"),
            dict(base, arm="qerl_single_lora", step_s=3.0, run="r2"), dict(base, arm="trl_bf16", step_s=5.0),
            dict(base, arm="qerl", step_s=5.0)]
    e2e.add_speedups(rows)
    assert [r["speedup_vs_trl_bf16"] for r in rows] == [1.0, 1.5, None, None, None]


def test_merge_keeps_each_call_of_a_split_setting_with_its_own_baseline(tmp_path):
    """2x8x2048 does not fit one 10-minute call with three arms: two calls at one commit, each with TRL's arm. Both
    TRL rows stay, and each QeRL row's speed-up is against the TRL row of its own call."""
    base = dict(size="7b", prompts=2, generations=8, completion_len=2048, sleep=True, generation="vllm", status="ok")

    def call(name, run, rows):
        meta = {"_meta": {"gpu": "H100", "gpu_tag": "h100", "versions": {}, "commit": "c1", "command": "x", "run": run}}
        path = tmp_path / name
        path.write_text("\n".join(json.dumps(x) for x in [meta] + [dict(base, **r) for r in rows]))
        return str(path)

    a = call("a.jsonl", "r1", [dict(arm="trl_bf16", step_s=20.0), dict(arm="qerl_single_lora", step_s=16.0)])
    b = call("b.jsonl", "r2", [dict(arm="trl_bf16", step_s=21.0), dict(arm="qerl", step_s=17.5)])
    env = json.loads(open(e2e.merge([a, b], str(tmp_path / "out"), None, None, None)).read())
    got = [(r["arm"], r["run"], r["speedup_vs_trl_bf16"]) for r in env["rows"]
           if r["completion_len"] == 2048 and r["status"] == "ok"]
    assert got == [("trl_bf16", "r1", 1.0), ("trl_bf16", "r2", 1.0), ("qerl", "r2", 1.2),
                   ("qerl_single_lora", "r1", 1.25)]
    assert env["commit"] == "c1"


def test_merge_keeps_the_latest_row_fills_the_matrix_and_adds_speedups(tmp_path):
    meta = {"_meta": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_tag": "h100", "versions": {"vllm": "0.24.0"},
                      "commit": "abc", "command": "python benchmarks/e2e_step.py --sizes 7b"}}
    base = dict(size="7b", prompts=2, generations=8, completion_len=512, sleep=False, generation="vllm")
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps(x) for x in [
        meta, dict(base, arm="qerl", status="failed: boom"), dict(base, arm="trl_bf16", status="ok", step_s=6.0)]))
    b.write_text("\n".join(json.dumps(x) for x in [
        dict(meta, _meta=dict(meta["_meta"], commit="def")), dict(base, arm="qerl", status="ok", step_s=4.0)]))
    cut = "7b/qerl/8x8-512-sleep"
    path = e2e.merge([str(a), str(b)], str(tmp_path / "out"), None, None, None,
                     {cut: "not_run: cut off by the device's time limit"})
    env = json.loads(open(path).read())
    assert path.endswith("e2e_step-h100.json")
    assert set(env) == {"benchmark", "gpu", "versions", "commit", "command", "rows"}
    assert env["gpu"] == "NVIDIA H100 80GB HBM3" and env["commit"] == "abc, def"
    rows = {e2e.row_name(r): r for r in env["rows"]}
    # every matrix row is there, in matrix order, whatever ran
    assert list(rows) == [s.name for s in e2e.default_matrix()]
    q, t = rows["7b/qerl/2x8-512-nosleep"], rows["7b/trl_bf16/2x8-512-nosleep"]
    # two runs (files without a run id, at two commits): no speed-up between them
    assert q["status"] == "ok" and q["speedup_vs_trl_bf16"] is None and q["commit"] == "def"
    assert t["commit"] == "abc" and t["speedup_vs_trl_bf16"] is None
    assert rows[cut]["status"].startswith("not_run: cut off")
    assert rows["32b/trl_bf16/1x8-2048-sleep"]["status"].startswith("not_run: a 32B BF16 checkpoint")
    assert rows["14b/qerl/8x8-512-sleep"]["status"] == "not_run: not measured"
    with pytest.raises(ValueError, match="measured rows"):
        e2e.merge([str(a), str(b)], str(tmp_path / "o2"), None, None, None, {"7b/qerl/2x8-512-nosleep": "x"})
    with pytest.raises(ValueError, match="outside the matrix"):
        e2e.merge([str(a)], str(tmp_path / "o3"), None, None, None, {"7b/qerl/9x9": "x"})


def test_peak_memory_reads_the_gpu_torch_runs_on_not_nvmls_index(monkeypatch):
    """NVML ignores CUDA_VISIBLE_DEVICES: in a lane that sees only physical GPU 1, NVML's index 0 is GPU 0. The
    sampler finds its GPU by the UUID torch gives for its own device."""
    from benchmarks import _common

    class Nvml:
        def nvmlDeviceGetHandleByIndex(self, i):
            raise AssertionError("an index names another GPU under CUDA_VISIBLE_DEVICES")

        def nvmlDeviceGetHandleByUUID(self, uuid):
            return uuid

    monkeypatch.setattr(_common, "gpu_uuid", lambda device=0: {0: "91ee96db-3099", 1: "c65b48ee-4672"}[device])
    assert e2e.nvml_handle(Nvml(), 0) == "GPU-91ee96db-3099"
    assert e2e.nvml_handle(Nvml(), 1) == "GPU-c65b48ee-4672"


def test_arms_take_a_micro_batch_and_no_gradient_checkpointing():
    """``--arms trl_bf16:mb16 qerl_single_lora:mb16:nogc``: each arm at its own best settings, named apart in the
    rows, and TRL's fastest setting of a run is every row's baseline."""
    assert e2e.parse_arm("trl_bf16") == {"arm": "trl_bf16", "micro_batch": None, "grad_ckpt": True, "fused_is": False,
                                         "humming_ahead": False, "expand_in_gemm": False,
                                         "lora_experts": False}  # fmt: skip
    assert e2e.parse_arm("qerl_single_lora:mb16:nogc:fis") == {"arm": "qerl_single_lora", "micro_batch": 16,
                                                               "grad_ckpt": False, "fused_is": True,
                                                               "humming_ahead": False, "expand_in_gemm": False,
                                                               "lora_experts": False}  # fmt: skip
    assert e2e.parse_arm("qerl_single_lora:ahead")["humming_ahead"]
    expand = e2e.RowSpec("7b", **e2e.parse_arm("qerl_single_lora:expand:fis"), prompts=2, generations=8,
                         completion_len=512, sleep=False)  # fmt: skip
    assert expand.expand_in_gemm and expand.arm_options == "qerl_single_lora:fis:expand"
    assert e2e.parse_arm("qerl_inplace:experts")["lora_experts"]
    experts = e2e.RowSpec("7b", **e2e.parse_arm("qerl:experts"), prompts=2, generations=8, completion_len=512,
                          sleep=False)  # fmt: skip
    assert experts.arm_options == "qerl:experts" and "dense" in e2e.unrunnable(experts)
    # options in any order select the row (rows name them in one order)
    arm = ["qerl_inplace:experts:fis"]
    picked = e2e.select(e2e.default_matrix(arm), ["30b-a3b"], arm, None)
    assert [s.name for s in picked] == ["30b-a3b/qerl_inplace:fis:experts/2x8-512-sleep"]
    assert e2e.RowSpec("7b", **e2e.parse_arm("qerl_single_lora:fis:ahead"), prompts=2, generations=8,
                       completion_len=512, sleep=False).arm_options == "qerl_single_lora:fis:ahead"  # fmt: skip
    for bad in ("trl", "qerl:mb0", "qerl:fast", "trl_bf16:fis", "trl_bf16:ahead", "qerl:ahead",
                "qerl_single_lora:experts", "qerl:expand", "trl_bf16:expand"):
        with pytest.raises(ValueError, match="unknown arm"):
            e2e.parse_arm(bad)
    arms = ["trl_bf16", "trl_bf16:mb16", "qerl_single_lora:mb16:nogc", "qerl_single_lora:mb16:fis"]
    specs = e2e.select(e2e.default_matrix(arms), ["7b"], arms, ["2x8-512-nosleep"])
    assert [s.name for s in specs] == ["7b/trl_bf16/2x8-512-nosleep", "7b/trl_bf16:mb16/2x8-512-nosleep",
                                       "7b/qerl_single_lora:mb16:nogc/2x8-512-nosleep",
                                       "7b/qerl_single_lora:mb16:fis/2x8-512-nosleep"]  # fmt: skip
    row = {"size": "7b", "arm": "qerl", "prompts": 2, "generations": 8, "completion_len": 512, "sleep": False}
    assert e2e.row_name(row) == "7b/qerl/2x8-512-nosleep"  # a row from before the options
    rows = [dict(row, arm="trl_bf16", step_s=6.0, status="ok", run="r"),
            dict(row, arm="trl_bf16", micro_batch=16, step_s=5.0, status="ok", run="r"),
            dict(row, arm="qerl_single_lora", micro_batch=16, step_s=4.0, status="ok", run="r")]
    e2e.add_speedups(rows)
    assert [r["speedup_vs_trl_bf16"] for r in rows] == [0.833, 1.0, 1.25]
    with pytest.raises(SystemExit):
        e2e.main(["--arms", "qerl:mb", "--list"])


def test_a_selection_matching_no_row_is_an_error_that_names_the_settings(tmp_path, capsys):
    """``--only 2x8-512`` (the setting is ``2x8-512-nosleep``) ran nothing on a GPU and wrote an empty result."""
    with pytest.raises(SystemExit):
        e2e.main(["--sizes", "7b", "--only", "2x8-512", "--arms", "trl_bf16", "--out-dir", str(tmp_path / "out"),
                  "--work", str(tmp_path / "work")])  # fmt: skip
    err = capsys.readouterr().err
    assert "no row of the matrix matches" in err and "2x8-512-nosleep" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()  # nothing written


@pytest.mark.slow
def test_an_arm_at_its_own_micro_batch_without_checkpointing_trains(tiny, tmp_path):
    work = str(tmp_path)
    e2e.prepare_checkpoints(work, tiny, need_bf16=False)
    spec = e2e.RowSpec(tiny, "qerl", prompts=2, generations=4, completion_len=6, sleep=False, generation="hf",
                       micro_batch=4, grad_ckpt=False)  # fmt: skip
    trainer = e2e.build_trainer(spec, work, steps=1)
    assert trainer.args.per_device_train_batch_size == 4 and trainer.args.gradient_accumulation_steps == 2
    assert not trainer.args.gradient_checkpointing
    row = e2e.run_row(spec, work, steps=2)
    assert row["micro_batch"] == 4 and row["grad_ckpt"] is False and e2e.row_name(row) == spec.name


def test_the_moe_row_trains_qerl_from_bf16_and_records_trl_as_not_run_where_two_bf16_copies_do_not_fit(capsys):
    """Issue #54's row: Qwen3-30B-A3B at 2 x 8 x 512 with sleep mode. TRL colocate holds two BF16 copies (2 x 57 GiB):
    not run on an 80 GB card, run on a 141 GB one; QeRL arms always run."""
    e2e.main(["--sizes", "30b-a3b", "--arms", "trl_bf16", "qerl_single_lora", "--list"])
    listed = capsys.readouterr().out.split()
    assert listed == ["30b-a3b/trl_bf16/2x8-512-sleep", "30b-a3b/qerl_single_lora/2x8-512-sleep"]
    trl = e2e.RowSpec("30b-a3b", "trl_bf16", 2, 8, 512, True)
    assert "not_run: TRL colocate holds the BF16 policy (57 GiB)" in e2e.unrunnable(trl, card_gib=79.2)
    assert e2e.unrunnable(trl, card_gib=139.8) is None
    assert e2e.unrunnable(e2e.RowSpec("30b-a3b", "qerl_single_lora", 2, 8, 512, True), card_gib=79.2) is None


@pytest.mark.slow
def test_a_moe_qerl_arm_trains_from_its_nvfp4_checkpoint(monkeypatch, tmp_path):
    from benchmarks import random_models as rm
    from tests.test_random_models import MOE_TINY

    monkeypatch.setitem(e2e.SIZES, "tiny-moe", rm.qwen3_moe_config("qwen3-30b-a3b", **MOE_TINY))
    monkeypatch.setitem(e2e.GPU_MEMORY_UTILIZATION, "tiny-moe", 0.3)
    monkeypatch.setattr(e2e, "MOE_SIZES", ("tiny-moe",))
    monkeypatch.setattr(e2e, "PROMPT_TOKENS", 12)
    work = str(tmp_path)
    e2e.prepare_checkpoints(work, "tiny-moe", need_bf16=False)
    spec = e2e.RowSpec("tiny-moe", "qerl_single_lora", prompts=2, generations=4, completion_len=6, sleep=False,
                       generation="hf")  # fmt: skip
    trainer = e2e.build_trainer(spec, work, steps=1)
    assert trainer.model.name_or_path.endswith("tiny-moe-nvfp4")
    assert any(type(m).__name__ == "NVFP4Experts" for m in trainer.model.modules())
    from qerl_trl.peft_lora import NVFP4ExpertsLora

    with_experts = e2e.build_trainer(dataclasses.replace(spec, arm="qerl", lora_experts=True), work, steps=1)
    assert sum(isinstance(m, NVFP4ExpertsLora) for m in with_experts.model.modules()) == MOE_TINY["num_hidden_layers"]
    row = e2e.run_row(spec, work, steps=2)
    assert row["status"] == "ok", row["status"]


def test_humming_cache_entries_count_the_compiled_kernels(tmp_path, monkeypatch):
    """A QeRL row records the cache's entries before its start and how many the start added: a cold start (issue #55
    item 4) is told from a warm one by the row itself."""
    monkeypatch.setenv("HUMMING_CACHE_DIR", str(tmp_path / "cache"))
    assert e2e.humming_cache_entries() == 0
    for h in ("a1", "b2", "c3"):
        (tmp_path / "cache" / h).mkdir(parents=True)
    assert e2e.humming_cache_entries() == 3


def test_cold_humming_gives_each_qerl_row_an_empty_kernel_cache_of_its_own(tmp_path, monkeypatch):
    """``--cold-humming``: every QeRL row's child starts on an empty ``HUMMING_CACHE_DIR`` of its own (so its
    ``init_s`` is a first start's, issue #55 item 4), TRL's rows on the machine's own."""
    from benchmarks import _child

    seen = []

    def fake_child(cmd, timeout, env, log_path):
        spec = json.loads(cmd[cmd.index("--child") + 1])
        with open(log_path, "w") as f:
            f.write(f"INFO [default_loader.py:431] Loading weights took {len(seen) + 1}.50 seconds\n")
        cache = env.get("HUMMING_CACHE_DIR")
        seen.append((spec["arm"], cache))
        if cache:
            assert os.listdir(cache) == []
            open(os.path.join(cache, "kernel"), "w").close()  # this row's compile, not seen by the next
        row = dict(spec, status="ok", step_s=1.0)
        with open(cmd[cmd.index("--row-out") + 1], "w") as f:
            json.dump(row, f)
        return _child.ChildResult(0, False, 60.0, "", 1.0)

    monkeypatch.setattr(_child, "run_child", fake_child)
    monkeypatch.setattr(e2e.subprocess, "run", lambda *a, **k: e2e.subprocess.CompletedProcess(a, 0, "{}", ""))
    monkeypatch.delenv("HUMMING_CACHE_DIR", raising=False)
    arms = ["trl_bf16", "qerl_single_lora:ahead", "qerl_single_lora"]
    specs = e2e.select(e2e.default_matrix(arms), ["7b"], arms, ["2x8-512-nosleep"])
    rows = e2e.run_matrix(specs, str(tmp_path), 2, str(tmp_path / "rows.jsonl"), 60, "r1", cold_humming=True)
    assert [r["status"] for r in rows] == ["ok"] * 3
    assert [r["engine_phases"] for r in rows] == [{"load_weights_s": 1.5}, {"load_weights_s": 2.5},
                                                  {"load_weights_s": 3.5}]  # each row's own log
    assert seen[0] == ("trl_bf16", None)
    caches = [c for _, c in seen[1:]]
    assert len(set(caches)) == 2 and all(c.startswith(str(tmp_path)) for c in caches)
    seen.clear()
    e2e.run_matrix(specs, str(tmp_path), 2, str(tmp_path / "rows.jsonl"), 60, "r2")
    assert [c for _, c in seen] == [None, None, None]


def test_a_rows_start_up_phases_come_from_the_lines_vllm_logs():
    """Issue #55 item 4: where a cold trainer start's time goes (weights, torch.compile, memory profiling with
    Humming's first forward, CUDA graphs). The lines are vLLM 0.24's own format strings, filled in."""
    log = "\n".join([
        "(EngineCore pid=1) INFO 11-28 [default_loader.py:431] Loading weights took %.2f seconds" % 3.21,
        "INFO [gpu_model_runner.py:5256] Model loading took %s GiB memory and %.6f seconds" % ("5.6", 9.123456),
        "INFO [backends.py:1149] Dynamo bytecode transform time: %.2f s" % 8.5,
        "INFO [backends.py:394] Compiling a graph for compile range %s takes %.2f s" % ("(1, 8192)", 20.25),
        "INFO [backends.py:394] Compiling a graph for compile range %s takes %.2f s" % ("(1, 16)", 1.75),
        "INFO [monitor.py:20] torch.compile took %.2f s in total" % 31.0,
        "INFO [mem_utils.py:217] Memory profiling takes %.2f seconds. the current vLLM instance can use" % 40.5,
        "INFO [gpu_model_runner.py:6657] Graph capturing finished in %.0f secs, took %.2f GiB" % (12, 0.4),
        "INFO [core.py:345] init engine (profile, create kv cache, warmup model) took %.2f s" % 60.0,
        "qerl-trl: compiled Humming's kernels ahead for layer config 1 of 4 in 5.0 s, 5.5 s after the first was "
        "queued",
        "qerl-trl: compiled Humming's kernels ahead for layer config 4 of 4 in 9.0 s, 30.5 s after the first was "
        "queued",
    ])  # fmt: skip
    assert e2e.engine_log_phases(log) == {
        "load_weights_s": 3.21, "model_loading_s": 9.12, "dynamo_s": 8.5, "inductor_s": 22.0, "torch_compile_s": 31.0,
        "memory_profiling_s": 40.5, "cuda_graphs_s": 12.0, "init_engine_s": 60.0, "humming_ahead_last_done_s": 30.5}
    assert e2e.engine_log_phases("nothing logged") == {}


def test_a_row_child_logs_vllms_start_up_lines(tmp_path, monkeypatch):
    """TRL sets vLLM's log level to ERROR unless it is set; the child sets INFO first, so the row's engine_phases
    have vLLM's lines to read, and the compile-ahead thread's timing lines reach its output."""
    import logging

    seen = {}

    def fake_row(spec, work, steps, card_gib):
        seen["level"] = os.environ.get("VLLM_LOGGING_LEVEL")
        seen["ahead"] = logging.getLogger("qerl_trl.vllm_plugin.humming_ahead").isEnabledFor(logging.INFO)
        return {"status": "ok"}

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setattr(e2e, "run_row", fake_row)
    spec = e2e.default_matrix(["qerl_single_lora:ahead"])[0]
    e2e._child(spec, str(tmp_path), 2, str(tmp_path / "row.json"))
    assert seen == {"level": "INFO", "ahead": True}
    assert json.loads((tmp_path / "row.json").read_text()) == {"status": "ok"}


def test_the_memory_peak_is_kept_by_phase_of_the_step():
    """Issue #54: the 30B-A3B row peaked at 62.9 GiB, and nothing said whether in the rollout (the engine awake beside
    the trainer) or in the training pass. Each ``_Timed`` call is its sampler's phase while it runs."""
    mem = e2e._PeakMemory()
    readings = iter([10, 30, 20, 25, 40, 5])
    mem._used = lambda: next(readings) * 2**30
    mem._thread = object()  # sampling as if started (no GPU here)

    class Engine:
        def generate(self):
            mem.sample()  # a reading while the engine decodes

    engine = Engine()
    timed = e2e._Timed(engine, "generate", mem, "rollout")
    mem.sample()  # 10 in the training pass
    engine.generate()  # enter: 30 ends "train"; inside: 20; leave: 25 ends "rollout"
    mem.sample()  # 40 in the training pass again
    assert mem.phase == "train" and timed.total > 0
    assert mem.by_phase_gib() == {"rollout": 25.0, "train": 40.0} and mem.peak == 40 * 2**30


def test_rows_record_how_closely_vllm_served_the_policy_from_the_logged_metrics():
    from qerl_trl.trainer.rollout_guard import RolloutPolicyGuard

    logs = [{"loss": 0.1, "sampling/sampling_logp_difference/mean": 0.02, "sampling/sampling_logp_difference/max": 0.9,
             "sampling/importance_sampling_ratio/min": 0.5, "sampling/importance_sampling_ratio/max": 1.7},
            {"loss": 0.2}]  # fmt: skip
    guard = RolloutPolicyGuard(max_gap=1.0)
    guard.update(1, 0.03, 0.0)
    guard.update(2, 2.5, 0.0)  # one bad round at the end
    out = e2e.rollout_agreement(logs, guard)
    assert out["logp_gap_mean_per_step"] == [0.02, None] and out["logp_gap_max_per_step"] == [0.9, None]
    assert out["is_ratio_min_per_step"] == [0.5, None] and out["is_ratio_max_per_step"] == [1.7, None]
    assert out["guard_bad_rounds"] == 1 and out["guard_last_gap"] == 2.5
    assert "guard_bad_rounds" not in e2e.rollout_agreement(logs, None)  # TRL's arms: no guard


def test_a_rounds_profile_splits_its_time_into_gpu_work_by_kind_and_the_gpu_waiting(monkeypatch):
    """QERL_E2E_PROFILE_ROLLOUT=N: only the N-th rollout is profiled, what it returns is passed on, and the row gets
    its wall time, the GPU's busy time by decode_profile's categories, the idle rest and the costliest kernels."""
    from benchmarks import decode_profile

    events = [("humming_gemm_kernel", 0.0, 400.0), ("qerl_lora_shrink", 300.0, 500.0),  # overlapping: busy once
              ("flash_fwd_kernel", 600.0, 700.0), ("memcpy HtoD", 900.0, 950.0)]
    monkeypatch.setattr(decode_profile, "gpu_events", lambda prof: events)

    class Engine:
        def generate(self, x):
            return x * 2

    engine = Engine()
    prof = e2e._profile_round(engine, "generate", 2)
    assert engine.generate(1) == 2 and prof.result is None  # the first round runs as it is
    assert engine.generate(3) == 6 and prof.result is not None
    out = prof.result
    assert out["step"] == 2 and out["gpu_busy_ms"] == 0.7 and out["gpu_span_ms"] == 0.9
    assert out["gpu_idle_ms"] == pytest.approx(out["wall_ms"] - 0.7, abs=0.11)
    assert out["ms_by_category"] == {"fp4_gemm": 0.4, "lora": 0.2, "attention": 0.1, "copy": 0.1}
    assert [k["kernel"] for k in out["top_kernels"]][:2] == ["humming_gemm_kernel", "qerl_lora_shrink"]
    first = out
    assert engine.generate(4) == 8 and prof.result is first and prof.calls == 3  # later rounds: not again

